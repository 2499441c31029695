"""What the feature-head families with a reduced draft vocabulary share (EAGLE-3, DFlash): the choice of target
layers they fuse, the draft vocabulary built from the training data, and the draft->target map's checks."""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any

import torch

from data.config import ConfigError


def default_layer_ids(num_layers: int) -> list[int]:
    """The target layers EAGLE-3 fuses unless told otherwise: ``(2, N//2, N-3)`` (HF ``hidden_states`` indices),
    the choice of vLLM, SGLang and speculators for an N-layer target."""
    n = int(num_layers)
    return [2, n // 2, n - 3]


def layer_ids_for(layer_ids: list[int] | None, target_config: Any) -> list[int]:
    """The target layers a head fuses: ``layer_ids`` (HF ``hidden_states`` indices) checked against an N-layer
    target, or :func:`default_layer_ids` when None or empty."""
    n = int(target_config.num_hidden_layers)
    ids = list(layer_ids) if layer_ids else default_layer_ids(n)
    bad = [i for i in ids if not 0 <= int(i) <= n]
    if bad or not ids:
        raise ConfigError(f"drafter.layer_ids={ids}: every id must be in 0..{n} (HF hidden_states indices)")
    return [int(i) for i in ids]


def vocab_hash(d2t: torch.Tensor) -> str:
    """A short hash of the draft->target map, stored in config.json and checked against the tensors on load."""
    return hashlib.sha256(d2t.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:16]


def build_vocab(rows: list[Any], vocab_size: int, draft_vocab_size: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """The draft vocabulary: the ``draft_vocab_size`` most frequent target-written tokens of ``rows`` (ties by
    lower id), topped up with the most frequent prompt tokens, then the lowest unused ids; sorted ascending.

    Returns the target ids ``[draft_vocab_size]`` and coverage figures."""
    written: Counter[int] = Counter()
    other: Counter[int] = Counter()
    for r in rows:
        for tok, m in zip(r.input_ids, r.loss_mask, strict=True):
            (written if m else other)[tok] += 1
    chosen: list[int] = [t for t, _ in sorted(written.items(), key=lambda kv: (-kv[1], kv[0]))][:draft_vocab_size]
    seen = set(chosen)
    for t, _ in sorted(other.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= draft_vocab_size:
            break
        if t not in seen:
            chosen.append(t)
            seen.add(t)
    nxt = 0
    while len(chosen) < draft_vocab_size:
        if nxt not in seen:
            chosen.append(nxt)
            seen.add(nxt)
        nxt += 1
    ids = torch.tensor(sorted(chosen), dtype=torch.long)
    total = sum(written.values())
    covered = sum(c for t, c in written.items() if t in seen)
    info = {
        "draft_vocab_size": draft_vocab_size,
        "distinct_target_written_tokens": len(written),
        "target_written_token_coverage": round(covered / max(1, total), 5),
    }
    if any(t >= vocab_size for t in chosen):
        raise ValueError(f"training data holds token ids >= the target vocabulary ({vocab_size})")
    return ids, info


def check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor, draft_vocab_size: int, vocab_size: int) -> None:
    """Refuse a d2t/t2d pair that is not a consistent, sorted, in-range map of ``draft_vocab_size`` entries."""
    problems = []
    if d2t.dtype not in (torch.int64, torch.int32) or d2t.shape != (draft_vocab_size,):
        problems.append(f"d2t must be int64[{draft_vocab_size}], got {d2t.dtype}{list(d2t.shape)}")
    if t2d.shape != (vocab_size,):
        problems.append(f"t2d must have the target's vocabulary size {vocab_size}, got {list(t2d.shape)}")
    if not problems:
        tid = torch.arange(draft_vocab_size) + d2t.long()
        if tid.min() < 0 or tid.max() >= vocab_size:
            problems.append("d2t maps draft ids outside the target vocabulary")
        elif draft_vocab_size > 1 and not bool((tid[1:] > tid[:-1]).all()):
            problems.append("d2t does not map to strictly increasing target ids (duplicates or unsorted)")
        elif int(t2d.bool().sum()) != draft_vocab_size or not bool(t2d.bool()[tid].all()):
            problems.append("t2d does not mark exactly the target ids that d2t maps to")
    if problems:
        raise ValueError("corrupt EAGLE-3 vocabulary map: " + "; ".join(problems))
