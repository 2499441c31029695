"""Reference runs of HF transformers' own speculative decoding, instrumented like ours.

* Assisted generation (Leviathan et al., 2023, as implemented in ``GenerationMixin._assisted_decoding``):
  ``target.generate(input_ids, assistant_model=draft, do_sample=False, ...)``.
* Prompt lookup decoding (Saxena, 2023): ``target.generate(input_ids, prompt_lookup_num_tokens=K)``.

The target's forward calls are counted with a forward pre-hook that also records, per call, the
number of input tokens and the KV-cache length before the call; from these the per-step draft
lengths and accepted counts are reconstructed into a :class:`eval.metrics.DecodeStats`.

Structural differences to :class:`eval.decoder.SpeculativeDecoder` (documented so comparisons stay
apples to apples):

* HF has no separate prefill: its first forward runs ``prompt + first draft`` and is both the
  prefill and the first verification.  Here it is counted as a verification step (and as the
  prefill), so ``stats.tau()`` covers every HF forward; ``tau_hf`` = new tokens / target forwards.
  Ours emits the first token from a plain prefill and drafts only afterwards.  Running HF on
  ``prompt + [our first token]`` with ``max_new_tokens - 1`` makes the two step sequences identical
  at temperature 0 (see tests/test_eval/test_hf_compare.py).
* Near ``max_length`` HF drafts at most ``max_length - cur_len - 1`` tokens; our decoder truncates
  drafts to the remaining budget minus one in the same way.
* HF reads ``num_assistant_tokens`` / ``num_assistant_tokens_schedule`` /
  ``assistant_confidence_threshold`` from the ASSISTANT's ``generation_config`` (transformers 5.x
  ``AssistedCandidateGenerator.__init__``), so they are set there for the call and restored after.
  ``assistant_confidence_threshold=0`` disables the early-exit ``ConfidenceCriteria`` (it is only
  added when the threshold is ``> 0``) and the sklearn threshold adaptation (``0`` is falsy).
* HF prompt lookup uses the FIRST (leftmost) earlier match of the n-gram, ours the most recent.

Only greedy decoding is exposed: HF sampling draws from the global torch RNG.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from eval.metrics import DecodeStats

logger = logging.getLogger(__name__)

__all__ = [
    "ForwardRecorder",
    "HFGenerationResult",
    "hf_assisted_generate",
    "hf_greedy_generate",
    "hf_prompt_lookup_generate",
    "record_forwards",
]


@dataclass
class ForwardRecorder:
    """Per forward call of the hooked model: ``(n_input_tokens, cache_len_before)``."""

    calls: list[tuple[int, int]] = field(default_factory=list)

    @property
    def n_forwards(self) -> int:
        """Number of forward calls seen."""
        return len(self.calls)


@contextmanager
def record_forwards(model: torch.nn.Module) -> Iterator[ForwardRecorder]:
    """Count ``model``'s forward calls (top-level module only) while the context is active."""
    rec = ForwardRecorder()

    def hook(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        n_in = int(ids.shape[1]) if ids is not None else 0
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = int(cache.get_seq_length()) if cache is not None else 0
        rec.calls.append((n_in, past))

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield rec
    finally:
        handle.remove()


@dataclass
class HFGenerationResult:
    """Tokens (new only), reconstructed per-step stats and wall time of one HF generation."""

    tokens: list[int]
    stats: DecodeStats
    wall_time_s: float

    @property
    def tau_hf(self) -> float:
        """New tokens per target forward (HF's first forward is prefill + first verification)."""
        f = self.stats.target_forwards
        return self.stats.new_tokens / f if f else float("nan")


def _stats_from_calls(calls: list[tuple[int, int]], prompt_len: int, n_new: int, wall: float) -> DecodeStats:
    """Rebuild per-step draft / accepted counts from the recorded target calls.

    Step ``j`` starts with ``committed_j`` tokens (``prompt_len`` for the first call, else
    ``cache_len + 1``: every committed token but the last is cached) and verifies
    ``drafts_j = n_in - 1`` tokens (``n_in - prompt_len`` for the first call);
    ``accepted_j = committed_{j+1} - committed_j - 1`` (the last step uses the final length).
    """
    stats = DecodeStats(n_sequences=1, new_tokens=n_new, total_time_s=wall, target_time_s=wall)
    stats.target_forwards = len(calls)
    stats.prefill_forwards = 1 if calls else 0
    committed = [prompt_len if j == 0 else past + 1 for j, (_, past) in enumerate(calls)]
    drafts = [n_in - prompt_len if j == 0 else n_in - 1 for j, (n_in, _) in enumerate(calls)]
    committed.append(prompt_len + n_new)
    for j in range(len(calls)):
        acc = max(0, min(drafts[j], committed[j + 1] - committed[j] - 1))
        stats.record_step(acc, min(drafts[j], acc + 1), drafts[j])
    return stats


def _run(model: torch.nn.Module, input_ids: torch.Tensor, **kwargs: Any) -> HFGenerationResult:
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    with record_forwards(model) as rec:
        t0 = time.perf_counter()
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
        wall = time.perf_counter() - t0
    seq = out.sequences if hasattr(out, "sequences") else out
    tokens = seq[0, input_ids.shape[1] :].tolist()
    stats = _stats_from_calls(rec.calls, int(input_ids.shape[1]), len(tokens), wall)
    return HFGenerationResult(tokens=tokens, stats=stats, wall_time_s=wall)


def _gen_kwargs(max_new_tokens: int, eos_token_id: int | list[int] | None) -> dict[str, Any]:
    return {
        "do_sample": False,
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": 0,
        "eos_token_id": eos_token_id,
        # no pad token warning for tiny test models; harmless for real ones (batch size 1)
        "pad_token_id": eos_token_id[0] if isinstance(eos_token_id, list) else (eos_token_id or 0),
    }


@torch.inference_mode()
def hf_greedy_generate(
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
) -> HFGenerationResult:
    """Plain HF greedy decoding (``do_sample=False``), instrumented the same way."""
    return _run(target, input_ids, **_gen_kwargs(max_new_tokens, eos_token_id))


@torch.inference_mode()
def hf_assisted_generate(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    num_assistant_tokens: int,
    eos_token_id: int | list[int] | None = None,
) -> HFGenerationResult:
    """HF assisted generation with a constant draft length and no confidence early exit (greedy).

    Args:
        input_ids: ``LongTensor[1, T]``.
        num_assistant_tokens: draft length ``K`` every step (schedule ``"constant"``).
    """
    gc = draft.generation_config
    saved = {
        k: getattr(gc, k, None)
        for k in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    }
    gc.num_assistant_tokens = num_assistant_tokens
    gc.num_assistant_tokens_schedule = "constant"
    gc.assistant_confidence_threshold = 0.0
    try:
        return _run(
            target,
            input_ids,
            assistant_model=draft,
            num_assistant_tokens=num_assistant_tokens,
            num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0,
            **_gen_kwargs(max_new_tokens, eos_token_id),
        )
    finally:
        for k, v in saved.items():
            setattr(gc, k, v)


@torch.inference_mode()
def hf_prompt_lookup_generate(
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    prompt_lookup_num_tokens: int,
    max_matching_ngram_size: int | None = None,
    eos_token_id: int | list[int] | None = None,
) -> HFGenerationResult:
    """HF prompt lookup decoding (greedy); ``max_matching_ngram_size`` defaults to HF's (2)."""
    kwargs: dict[str, Any] = {"prompt_lookup_num_tokens": prompt_lookup_num_tokens}
    if max_matching_ngram_size is not None:
        kwargs["max_matching_ngram_size"] = max_matching_ngram_size
    return _run(target, input_ids, **kwargs, **_gen_kwargs(max_new_tokens, eos_token_id))
