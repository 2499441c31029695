"""What the feature-head families with a reduced draft vocabulary share (EAGLE-3, DFlash): the choice of target
layers they fuse, the draft vocabulary built from the training data, and the draft->target map's checks."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable
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


class DraftVocab:
    """What a head with a reduced draft vocabulary adds to its module (mixed into an ``nn.Module`` that has
    ``lm_head`` [draft_vocab_size rows], the buffers ``d2t`` and ``t2d`` and a ``draft_logits(h)`` method)."""

    lm_head: torch.nn.Linear
    d2t: torch.Tensor
    t2d: torch.Tensor

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def draft_vocab_size(self) -> int:
        return int(self.lm_head.out_features)

    def target_ids(self) -> torch.Tensor:
        """Target-vocabulary id of every draft-vocabulary entry, ``[draft_vocab_size]``."""
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def full_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft logits placed in the target's vocabulary (``-inf`` outside the draft vocabulary)."""
        d = self.draft_logits(h).float()
        out = torch.full((*d.shape[:-1], self.t2d.numel()), float("-inf"), device=d.device)
        out[..., self.target_ids()] = d
        return out


def init_draft_vocab(head: DraftVocab, rows: list[Any], target: Any) -> dict[str, Any]:
    """Build ``d2t``/``t2d`` from the training rows (:func:`build_vocab`; the identity for the full vocabulary) and
    start the draft LM head at the target's LM head rows of the chosen vocabulary. Returns the figures for the train
    manifest (coverage, the map's hash)."""
    V, vd = head.t2d.numel(), head.draft_vocab_size
    if vd == V:
        ids = torch.arange(V)
        info: dict[str, Any] = {"draft_vocab_size": V, "target_written_token_coverage": 1.0}
    else:
        ids, info = build_vocab(rows, V, vd)
    with torch.no_grad():
        head.d2t.copy_(ids - torch.arange(vd))
        head.t2d.zero_()
        head.t2d[ids] = True
        src = target.get_output_embeddings().weight
        head.lm_head.weight.copy_(src[ids.to(src.device)].to(head.lm_head.weight))
    info["d2t_hash"] = vocab_hash(head.d2t.cpu())
    return info


def check_saved_vocab(
    state: dict[str, torch.Tensor], meta: dict[str, Any], expected_hash: str | None, vocab_size: int, where: str
) -> int:
    """Refuse a saved head whose LM head, ``d2t``/``t2d`` or vocabulary hash do not agree with each other and with its
    config.json; returns the draft vocabulary size."""
    missing = [k for k in ("d2t", "t2d", "lm_head.weight") if k not in state]
    if missing:
        raise ValueError(f"{where} lacks {'/'.join(missing)}")
    vd = int(state["lm_head.weight"].shape[0])
    if vd != int(meta.get("draft_vocab_size", -1)):
        raise ValueError(
            f"{where}: lm_head has {vd} rows but config.json says draft_vocab_size={meta.get('draft_vocab_size')}"
        )
    check_vocab_maps(state["d2t"], state["t2d"], vd, vocab_size)
    if expected_hash is not None and vocab_hash(state["d2t"]) != expected_hash:
        raise ValueError(
            f"{where}: d2t does not match the vocabulary the head was trained with (hash {vocab_hash(state['d2t'])} "
            f"!= {expected_hash}); a d2t rebuilt from other data silently collapses acceptance"
        )
    return vd


def fused_features(layer_ids: list[int], num_layers: int) -> Callable[[dict[int | str, torch.Tensor]], torch.Tensor]:
    """The decoder's hidden-state dict -> the concatenated target layers a head fuses (``num_layers`` = the final
    states, delivered as ``"last"``)."""

    def feature_fn(hs: dict[int | str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([hs["last"] if i == num_layers and i not in hs else hs[i] for i in layer_ids], dim=-1)

    return feature_fn
