"""Statistics of acceptance over prompts: bootstrap intervals of tau and paired differences between runs.

tau of a sample is a ratio (tokens emitted over verification steps, pooled over its prompts), so every replicate
resamples whole prompts and pools their counters the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from eval.metrics import DecodeStats

__all__ = ["bootstrap_tau_ci", "describe_interval", "describe_paired", "paired_tau_diff"]


def bootstrap_tau_ci(
    per_prompt: Sequence[DecodeStats], n_boot: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of tau over prompts (prompts resampled with replacement).

    tau of a sample is a ratio (tokens emitted over verification steps, pooled over its prompts), so each
    replicate pools the resampled prompts' counters the same way. NaN when there are no steps.
    """

    num = np.array([sum(a + 1 for a in s.accepted_lengths) for s in per_prompt], dtype=np.float64)
    den = np.array([len(s.accepted_lengths) for s in per_prompt], dtype=np.float64)
    if len(num) == 0 or den.sum() == 0:
        return math.nan, math.nan
    if len(num) == 1:
        t = float(num[0] / den[0]) if den[0] else math.nan
        return t, t
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(num), size=(n_boot, len(num)))
    d = den[idx].sum(1)
    taus = num[idx].sum(1)[d > 0] / d[d > 0]
    lo, hi = np.quantile(taus, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


def paired_tau_diff(
    a: dict[str, Any], b: dict[str, Any], n_boot: int = 2000, level: float = 0.95, seed: int = 0
) -> dict[str, Any] | None:
    """tau of ``b`` minus tau of ``a`` over the prompts both judged, with a paired bootstrap interval.

    ``a`` and ``b`` are ``per_prompt`` records of ``metrics.json`` (``ids``, ``emitted``, ``steps``; see
    ``eval.report.acceptance``): prompts are matched by id, and each replicate resamples the *same* prompts for both
    sides, so prompt-to-prompt variation (which dominates the separate intervals) cancels. Also counts the
    prompts where ``b``'s own tau is higher / lower. None when the records cannot be paired (no ids, or fewer
    than two shared prompts).
    """

    if not a or not b or not a.get("ids") or not b.get("ids"):
        return None
    ib = {k: j for j, k in enumerate(b["ids"])}
    pairs = [(i, ib[k]) for i, k in enumerate(a["ids"]) if k in ib]
    if len(pairs) < 2:
        return None
    ea = np.array([a["emitted"][i] for i, _ in pairs], dtype=np.float64)
    sa = np.array([a["steps"][i] for i, _ in pairs], dtype=np.float64)
    eb = np.array([b["emitted"][j] for _, j in pairs], dtype=np.float64)
    sb = np.array([b["steps"][j] for _, j in pairs], dtype=np.float64)
    if sa.sum() == 0 or sb.sum() == 0:
        return None
    diff = float(eb.sum() / sb.sum() - ea.sum() / sa.sum())
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(pairs), size=(n_boot, len(pairs)))
    da, db = sa[idx].sum(1), sb[idx].sum(1)
    ok = (da > 0) & (db > 0)
    reps = eb[idx].sum(1)[ok] / db[ok] - ea[idx].sum(1)[ok] / da[ok]
    lo, hi = np.quantile(reps, [(1 - level) / 2, 1 - (1 - level) / 2])
    both = (sa > 0) & (sb > 0)
    ta, tb = ea[both] / sa[both], eb[both] / sb[both]
    return {
        "diff": diff,
        "ci": [float(lo), float(hi)],
        "prompts": len(pairs),
        "better": int((tb > ta + 1e-12).sum()),
        "worse": int((tb < ta - 1e-12).sum()),
    }


def describe_paired(p: dict[str, Any] | None) -> str:
    """``+0.06 [+0.03, +0.09], 25 better / 6 worse of 36`` (``-`` when not paired)."""
    if p is None:
        return "-"
    lo, hi = p["ci"]
    return f"{p['diff']:+.3f} [{lo:+.3f}, {hi:+.3f}], {p['better']} better / {p['worse']} worse of {p['prompts']}"


def describe_interval(lo: float, hi: float) -> str:
    """``[lo, hi]`` with two decimals (``-`` when undefined)."""
    if math.isnan(lo) or math.isnan(hi):
        return "-"
    return f"[{lo:.2f}, {hi:.2f}]"
