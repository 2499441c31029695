"""Checks that recompute a reported figure from the counts it was derived from (instead of asserting a bound the
figure meets by definition, such as tau >= 1): they fail when the arithmetic or the bookkeeping behind it breaks."""

from __future__ import annotations

from typing import Any

import pytest


def assert_tau_derived(m: dict[str, Any]) -> None:
    """A method's per-source acceptance metrics: tau is the mean of its histogram of tokens per verification step
    and the total of the per-prompt counts (whichever of the two the report keeps; at least one), the two count the
    same steps, and the 95% interval holds tau."""
    hist = {int(k): int(v) for k, v in (m.get("tau_hist") or {}).items()}
    per = m.get("per_prompt")
    assert hist or per is not None, f"no counts behind tau in {sorted(m)}"
    if hist:
        steps = sum(hist.values())
        assert steps > 0 and min(hist) >= 1, hist
        assert m["tau"] == pytest.approx(sum(k * v for k, v in hist.items()) / steps, rel=1e-9)
    if per is not None:
        assert sum(per["steps"]) > 0 and (not hist or sum(per["steps"]) == steps)
        assert m["tau"] == pytest.approx(sum(per["emitted"]) / sum(per["steps"]), rel=1e-9)
    assert m["tau_ci"][0] <= m["tau"] <= m["tau_ci"][1]


def assert_best_is_best_check(manifest: dict[str, Any]) -> None:
    """A train manifest: ``best`` is the held-out check with the highest tau (the first such), at its step."""
    history = manifest["history"]
    assert history, "no held-out check recorded"
    taus = [h["heldout"]["all"]["tau"] for h in history]
    top = history[taus.index(max(taus))]
    assert manifest["result"]["best"]["tau"] == max(taus) and manifest["result"]["best"]["step"] == top["step"]
