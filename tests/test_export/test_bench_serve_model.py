"""scripts/bench_serve.py's cost model: the K it recommends per concurrency from the command's own figures."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import REPO


def _run(tps: float, drafts: int = 0, accepted: int = 0, per_pos: list[int] | None = None) -> dict:
    row = {"generated": 1000, "seconds": 1000 / tps, "tokens": [[1]]}
    if drafts:
        row.update({"drafts": drafts, "accepted": accepted, "per_pos": per_pos or []})
    return row


def test_cost_model_fits_the_step_cost_and_recommends_k() -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_serve import cost_model

    # Per draft: position 1 accepted 50%, 2 25%, 3 10%, 4 5%, 5 2%: E_k = 1.5, 1.75, 1.85, 1.90, 1.92.
    # Built from a step cost of exactly 1.0 + 0.1 K plain steps: ratio_K = E_K / (1 + 0.1 K).
    per_pos = [500, 250, 100, 50, 20]
    e = {2: 1.75, 3: 1.85, 5: 1.92}
    raw = {"plain": {"runs": {"1": _run(10.0)}}}
    for k, ek in e.items():
        raw[f"drafter_k{k}"] = {
            "runs": {"1": _run(10.0 * ek / (1 + 0.1 * k), 1000, round((ek - 1) * 1000), per_pos[:k])}
        }
    m = cost_model(raw, "1")
    assert m is not None
    assert m["step_cost_a"] == pytest.approx(1.0, abs=1e-3) and m["step_cost_b"] == pytest.approx(0.1, abs=1e-3)
    pred = m["predicted_vs_plain"]
    assert pred["1"] == pytest.approx(1.5 / 1.1, abs=2e-3) and pred["4"] == pytest.approx(1.90 / 1.4, abs=2e-3)
    assert m["recommended_k"] == 2  # 1.75 / 1.2 = 1.458 beats K=1 (1.364) and K=3 (1.423)

    # A saturated server (a step costs 1 + 0.6 K): no K pays, the model says plain decoding.
    raw2 = {"plain": raw["plain"]}
    raw2["drafter_k3"] = {"runs": {"1": _run(10.0 * 1.85 / 2.8, 1000, 850, per_pos[:3])}}
    m2 = cost_model(raw2, "1")
    assert m2 is not None and m2["step_cost_a"] == 1.0 and m2["step_cost_b"] == pytest.approx(0.6, abs=1e-3)
    assert m2["recommended_k"] == 0
    assert cost_model({"plain": raw["plain"]}, "1") is None  # nothing speculative measured
