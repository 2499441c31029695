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


def test_shared_prefix_is_computed_once_and_changes_nothing(target, prompts) -> None:
    """Prompts prefilled together reuse the keys and values of their common prefix (the chat template's system
    header here), computed once: the same last logits and cache (up to float rounding, each row's prefix moved
    next to its own tokens) and the same greedy rows; a later group reuses the remembered prefix."""
    import data.generate as gen
    from eval.decoder import plain_decode

    eos = target.tokenizer.eos_token_id
    header = gen._common_prefix(prompts)
    assert header >= gen.SHARED_PREFIX_MIN, "ChatML prompts share a system header"
    stats = gen.GenerationStats()
    memo = gen._PrefixMemo(target.model, torch.device("cpu"), stats)
    group = [prompts[1], prompts[2]]  # different lengths: the shorter row is padded
    with torch.inference_mode():
        prefix = memo.lookup(group)
        assert prefix[0] == header and stats.prefix_forwards == 1
        shared_logits, shared_kv = gen._prefill(target.model, group, torch.device("cpu"), prefix)
        whole_logits, whole_kv = gen._prefill(target.model, group, torch.device("cpu"))
        torch.testing.assert_close(shared_logits, whole_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(shared_logits.argmax(-1), whole_logits.argmax(-1))
        for (sk, sv), (wk, wv) in zip(shared_kv, whole_kv, strict=True):
            torch.testing.assert_close(sk, wk, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(sv, wv, rtol=1e-4, atol=1e-4)
        pad = len(prompts[2]) - len(prompts[1])
        assert pad > 0 and not shared_kv[0][0][0, :, :pad].any()  # padding columns zeroed, left of the prefix
        assert memo.lookup([prompts[4]]) == (header, memo.memo[0][1])  # one prompt: the remembered prefix
        assert stats.prefix_forwards == 1 and stats.prefix_tokens_reused == 3 * header
        assert memo.lookup([list(range(100, 140)), list(range(200, 240))]) == (0, None)  # nothing in common

    refs = [plain_decode(target.model, torch.tensor([p]), 16, eos).tokens for p in prompts]
    shared, st = continuous_generate(target.model, prompts, 16, eos_token_id=eos, batch_size=3)
    whole, st0 = continuous_generate(target.model, prompts, 16, eos_token_id=eos, batch_size=3, share_prefix=False)
    assert shared == whole == refs
    assert st.prefix_forwards >= 1 and st.prefix_tokens_reused >= header * 2
    assert st0.prefix_forwards == 0 and st0.prefix_tokens_reused == 0


def test_a_feed_streams_prompts_and_seeded_rows_do_not_depend_on_their_neighbours(target, prompts) -> None:
    """``more`` feeds prompts while others decode (numbered after the given ones, rows handed to ``on_finish``
    and then let go); with per-prompt ``seeds`` each sampled row is the same whatever the batch."""
    from eval.decoder import plain_decode

    eos = target.tokenizer.eos_token_id
    refs = [plain_decode(target.model, torch.tensor([p]), 16, eos).tokens for p in prompts]
    feeds = [prompts[2:4], prompts[4:], []]
    asked: list[int] = []
    got: dict[int, list[int]] = {}

    def more(want: int) -> list[list[int]]:
        asked.append(want)
        return list(feeds.pop(0)) if want > 0 and feeds else []

    outs, stats = continuous_generate(
        target.model, prompts[:2], 16, eos_token_id=eos, batch_size=3, more=more, on_finish=got.__setitem__
    )
    assert [got[i] for i in range(len(prompts))] == refs
    assert stats.prompts == len(prompts) and outs == [[]] * len(prompts)  # a stream keeps no rows
    assert max(asked) > 0 and min(asked) <= 0

    def sampled(batch_size: int, order: list[int]) -> dict[int, list[int]]:
        ps = [prompts[i] for i in order]
        outs, _ = continuous_generate(
            target.model,
            ps,
            16,
            eos_token_id=eos,
            batch_size=batch_size,
            temperature=1.0,
            seeds=[1000 + i for i in order],
        )
        return dict(zip(order, outs, strict=True))

    one = sampled(1, [0, 1, 2, 3, 4])
    assert sampled(3, [4, 2, 0, 1, 3]) == one
    assert one != {i: r for i, r in enumerate(refs)}  # sampled, not greedy
