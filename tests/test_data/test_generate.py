"""The continuous-batching engine (data/generate.py) on the real target: greedy rows equal batch-1 decoding while
rows end, are refilled with longer and shorter prompts, and cache columns are trimmed; sampling is reproducible."""

from __future__ import annotations

import pytest
import torch

from data.generate import continuous_generate
from data.render import prompt_ids

pytestmark = pytest.mark.slow

TEXTS = (
    "hi",
    "Answer with one word: what colour is the sky?",  # ends early: its slot is refilled
    "Write a Python function that reverses a string, with a docstring and two doctests.",
    "Ok",
    "Explain recursion to a child in three sentences, then give an example about Russian dolls and one "
    "about two mirrors facing each other.",  # admitted later and longer than every cached row: the cache widens
)


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    return [prompt_ids(target.tokenizer, [{"role": "user", "content": t}]) for t in TEXTS]


def test_rows_equal_batch1_greedy_decoding_with_refills(target, prompts) -> None:
    from eval.decoder import plain_decode

    eos = target.tokenizer.eos_token_id
    refs = [plain_decode(target.model, torch.tensor([p]), 24, eos).tokens for p in prompts]
    assert len(refs[1]) < 24 and refs[1][-1] == eos, "the one-word answer must end early (refill is tested)"
    for batch_size in (1, 2, 3):
        outs, stats = continuous_generate(target.model, prompts, 24, eos_token_id=eos, batch_size=batch_size)
        assert outs == refs, batch_size
        assert stats.generated_tokens == sum(len(r) for r in refs)
        assert stats.decode_slots == stats.generated_tokens - len(prompts)  # every decoded row made a token
        if batch_size > 1:  # every prompt after the first fill went into a finished row's slot, in place
            assert stats.admitted_in_place == len(prompts) - batch_size, (batch_size, stats)
    full, _ = continuous_generate(target.model, prompts, 24, eos_token_id=eos, batch_size=2, stop_at_eos=False)
    assert all(len(f) == 24 and f[: len(r)] == r for f, r in zip(full, refs, strict=True))


def test_sampling_is_reproducible_and_follows_the_temperature(target, prompts) -> None:
    eos = target.tokenizer.eos_token_id

    def run(seed: int, temperature: float) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        kw = {"eos_token_id": eos, "batch_size": 3, "temperature": temperature, "generator": g}
        return continuous_generate(target.model, prompts, 16, **kw)[0]

    assert run(0, 1.0) == run(0, 1.0)
    assert run(0, 1.0) != run(1, 1.0)
    greedy, _ = continuous_generate(target.model, prompts, 16, eos_token_id=eos, batch_size=3)
    assert run(0, 1e-4) == greedy  # a near-zero temperature samples the argmax


def test_prefill_groups_only_join_neighbours_of_similar_length() -> None:
    from data.generate import PREFILL_TOKENS, _prefill_groups

    assert _prefill_groups([]) == []
    assert _prefill_groups([10, 10, 11, 40, 41, 100]) == [3, 2, 1]
    assert _prefill_groups([50] * 3 + [5]) == [3, 1]  # 5 padded to 50 would be 10x its work
    assert sum(_prefill_groups([PREFILL_TOKENS // 4] * 9)) == 9
    assert max(_prefill_groups([PREFILL_TOKENS // 4] * 9)) == 4  # the token budget of one forward


def test_grouped_prefill_and_compaction_equal_batch1_decoding(target, prompts, monkeypatch) -> None:
    """Neighbours of similar length are prefilled in one padded forward, and rows outlive the columns allocated
    for them (a tiny headroom forces a compaction of the cache every few steps): the rows stay batch-1 greedy."""
    import data.generate as gen
    from eval.decoder import plain_decode

    eos = target.tokenizer.eos_token_id
    extra = ("Hey", "Name a colour.", "Write a Python function that adds two numbers, with a docstring.")
    similar = sorted(prompts + [prompt_ids(target.tokenizer, [{"role": "user", "content": t}]) for t in extra], key=len)
    assert len(gen._prefill_groups([len(p) for p in similar])) < len(similar), "some prompts must share a prefill"
    refs = [plain_decode(target.model, torch.tensor([p]), 20, eos).tokens for p in similar]
    monkeypatch.setattr(gen, "DECODE_HEADROOM", 3)
    outs, stats = continuous_generate(target.model, similar, 20, eos_token_id=eos, batch_size=4)
    assert outs == refs
    assert stats.generated_tokens == sum(len(r) for r in refs)
