"""Our decoder vs HF transformers' assisted generation / prompt lookup at temperature 0.

Apples-to-apples set-up (see eval/hf_baselines.py for the structural differences):

* HF has no separate prefill: its first forward verifies ``prompt + draft``, whereas we emit the
  first token from the prefill and draft afterwards.  So HF is run on ``prompt + [our first
  token]`` with ``max_new_tokens - 1``: from then on both loops start every step from the same
  committed context, with the same draft (the draft's greedy continuation of K tokens), and must
  reach the same verdicts.  HF's first forward then doubles as its prefill, which we do not count
  as a step on our side -- hence forwards_HF == our verification forwards.
* Near the end HF caps the draft at ``max_length - cur_len - 1``; our decoder truncates drafts to the
  remaining budget minus one, i.e. the same cap, so even the last steps coincide.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from eval.decoder import SpeculativeDecoder
from eval.hf_baselines import hf_assisted_generate, hf_greedy_generate, hf_prompt_lookup_generate
from eval.proposers import DraftModelProposer, PromptLookupProposer


@pytest.mark.parametrize("k", [1, 3, 5])
def test_same_steps_and_tau_as_hf_assisted_generation(target_and_draft: Any, k: int) -> None:
    pair = target_and_draft
    compared = 0
    for prompt in pair.prompts[:2]:
        ours = SpeculativeDecoder(
            pair.target, DraftModelProposer(pair.draft, pair.target.config.vocab_size, num_tokens=k)
        )
        res = ours.generate(prompt, pair.max_new_tokens, eos_token_id=pair.eos_token_id)
        eos = {pair.eos_token_id} if isinstance(pair.eos_token_id, int) else set(pair.eos_token_id or [])
        if res.tokens[0] in eos:
            continue
        aligned = torch.cat([prompt, torch.tensor([[res.tokens[0]]])], dim=1)
        hf = hf_assisted_generate(
            pair.target, pair.draft, aligned, pair.max_new_tokens - 1, k, eos_token_id=pair.eos_token_id
        )
        assert hf.tokens == res.tokens[1:]
        assert hf.stats.target_forwards == res.stats.target_forwards_excl_prefill
        if res.tokens[-1] in eos:
            # HF's assistant stops drafting at eos and HF counts accepted tokens after the eos cut,
            # so only the steps before the final one are comparable
            assert hf.stats.accepted_lengths[:-1] == res.stats.accepted_lengths[:-1]
            continue
        # HF drafted exactly K tokens per step except where the length cap binds (as ours)
        assert hf.stats.draft_tokens_proposed == res.stats.draft_tokens_proposed
        assert hf.stats.accepted_lengths == res.stats.accepted_lengths
        assert hf.stats.tau() == pytest.approx(res.stats.tau())
        # tau_HF = new tokens / forwards equals our tau when nothing was truncated
        assert hf.tau_hf == pytest.approx(res.stats.tau())
        compared += 1
    assert compared > 0


def test_unaligned_hf_runs_produce_the_greedy_output(target_and_draft: Any) -> None:
    """Without alignment the step boundaries differ, but every method returns the greedy output."""
    pair = target_and_draft
    prompt = pair.prompts[2]
    gc = pair.draft.generation_config
    settings = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    before = [getattr(gc, name, None) for name in settings]
    ref = hf_greedy_generate(pair.target, prompt, pair.max_new_tokens, pair.eos_token_id)
    assert ref.stats.target_forwards == len(ref.tokens)  # plain decoding: one forward per token
    assisted = hf_assisted_generate(pair.target, pair.draft, prompt, pair.max_new_tokens, 4, pair.eos_token_id)
    lookup = hf_prompt_lookup_generate(pair.target, prompt, pair.max_new_tokens, 4, eos_token_id=pair.eos_token_id)
    ours = SpeculativeDecoder(pair.target, PromptLookupProposer(num_tokens=4)).generate(
        prompt, pair.max_new_tokens, eos_token_id=pair.eos_token_id
    )
    assert assisted.tokens == ref.tokens == lookup.tokens == ours.tokens
    for r in (assisted, lookup):
        assert r.stats.target_forwards == r.stats.verify_steps
        assert sum(a + 1 for a in r.stats.accepted_lengths) == len(r.tokens)
        assert r.tau_hf == pytest.approx(len(r.tokens) / r.stats.target_forwards)
        assert r.wall_time_s > 0
    # the draft's generation_config is restored after the call
    assert [getattr(gc, name, None) for name in settings] == before
