"""The serving cost model (eval/serving.py): step costs, the K per batch size, vLLM's schedule ranges."""

from __future__ import annotations

import itertools

import pytest

from eval.metrics import expected_tokens_per_step
from eval.serving import (
    Measured,
    alpha_from_counts,
    best_k,
    expected_tokens,
    fit_step_cost,
    k_at,
    make_plan,
    schedule_from,
    step_cost,
)

ALPHA = [0.7, 0.6, 0.5, 0.4, 0.3]


def served(k: int, batch: int, plain_tps: float, a: float, b: float, alpha: list[float]) -> Measured:
    """What an engine whose speculative step costs exactly ``a + b K`` plain steps would measure (100,000 drafts)."""
    if k == 0:
        return Measured(0, batch, 1000, 1000 / plain_tps)
    e = expected_tokens(alpha, k)
    tps = plain_tps * e / (a + b * k)
    per_pos, prod = [], 100_000.0
    for x in alpha[:k]:
        prod *= x
        per_pos.append(round(prod))
    return Measured(k, batch, 1000, 1000 / tps, drafts=100_000, accepted=sum(per_pos), per_pos=per_pos)


def test_expected_tokens_and_counts_agree_with_the_eval_metric() -> None:
    for k in range(6):
        assert expected_tokens(ALPHA, k) == pytest.approx(expected_tokens_per_step(ALPHA, k))
    m = served(5, 1, 10.0, 1.1, 0.1, ALPHA)
    assert alpha_from_counts(m.drafts, m.per_pos) == pytest.approx(ALPHA, abs=2e-3)
    assert m.mean_acceptance_length == pytest.approx(expected_tokens(ALPHA, 5), abs=2e-3)


def test_step_cost_is_recovered_from_what_the_engine_measures() -> None:
    plain = served(0, 4, 50.0, 0, 0, ALPHA)
    pts = {k: step_cost(plain, served(k, 4, 50.0, 1.2, 0.15, ALPHA)) for k in (1, 3, 5)}
    assert pts == pytest.approx({k: 1.2 + 0.15 * k for k in (1, 3, 5)}, abs=2e-3)
    fit = fit_step_cost(pts)
    assert fit.a == pytest.approx(1.2, abs=2e-3) and fit.b == pytest.approx(0.15, abs=1e-3)
    one = fit_step_cost({3: 1.6})  # one K: the verification pass is taken as one plain step
    assert one.a == 1.0 and one.b == pytest.approx(0.2)
    flat = fit_step_cost({1: 1.3, 3: 1.2})  # a negative slope is noise: held at zero
    assert flat.b == 0.0 and flat.a == pytest.approx(1.25)
    assert fit(0) == 1.0


def test_best_k_is_the_argmax_or_off() -> None:
    cost = fit_step_cost({1: 1.1, 5: 1.5})  # a = 1.0, b = 0.1
    preds = {k: expected_tokens(ALPHA, k) / (1.0 + 0.1 * k) for k in range(1, 6)}
    k, r = best_k(ALPHA, cost, range(1, 6), 1.02)
    assert k == max(preds, key=lambda x: preds[x]) and r == pytest.approx(preds[k])
    saturated = fit_step_cost({1: 1.9, 3: 3.3})  # b = 0.7: no K beats plain decoding
    assert best_k(ALPHA, saturated, range(1, 6), 1.02) == (0, 1.0)
    marginal = fit_step_cost({1: 1.69})  # K=1: 1.7 / 1.69 = 1.006x, under the 1.02 margin
    assert best_k(ALPHA, marginal, [1], 1.02) == (0, 1.0)
    assert best_k(ALPHA, marginal, [1], 1.0)[0] == 1


def test_schedule_ranges() -> None:
    # Between two measured sizes the smaller K of the two: 3 lies between 2 (K=3) and 4 (K=2) -> K=2.
    s = schedule_from({1: 3, 2: 3, 4: 2, 8: 1, 16: 0, 32: 0}, 256)
    assert s == [[1, 2, 3], [3, 4, 2], [5, 8, 1], [9, 256, 0]]
    assert k_at(s, 3) == 2 and k_at(s, 2) == 3 and k_at(s, 5) == 1 and k_at(s, 12) == 0 and k_at(s, 300) == 0
    # Above the largest measured size: off, even where speculation still paid there.
    s2 = schedule_from({1: 4, 8: 2}, 64)
    assert s2 == [[1, 1, 4], [2, 8, 2], [9, 64, 0]]
    assert schedule_from({}, 16) == [[1, 16, 0]]
    assert schedule_from({1: 2, 4: 2}, 4) == [[1, 4, 2]]
    # What vLLM requires of it: starts at 1, sorted, inclusive, non-overlapping, contiguous, K >= 0.
    for ks in [{1: 5, 2: 4, 4: 3, 8: 0}, {2: 1, 16: 3}, {1: 0}]:
        s = schedule_from(ks, 128)
        assert s[0][0] == 1 and s[-1][1] == 128
        assert all(lo <= hi and k >= 0 for lo, hi, k in s)
        assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(s))


def test_plan_from_engine_measurements() -> None:
    """A machine where speculation pays at low load and costs more per token as the batch fills: the plan picks,
    per batch size, the K a brute-force search over the true costs picks, and turns speculation off where none pays."""
    truth = {1: (1.1, 0.05), 2: (1.1, 0.08), 4: (1.15, 0.15), 8: (1.2, 0.3), 16: (1.3, 0.6), 32: (1.4, 0.9)}
    code = [0.8, 0.7, 0.6, 0.5, 0.4]
    measured = []
    for b, (a, slope) in truth.items():
        measured.append(served(0, b, 20.0 * b**0.7, 0, 0, ALPHA))
        measured += [served(k, b, 20.0 * b**0.7, a, slope, ALPHA) for k in (1, 3, 5)]
    plan = make_plan(measured, {"all": ALPHA, "code": code}, 5, 1.02, 256)
    for b, (a, slope) in truth.items():
        assert plan.costs[b].a == pytest.approx(a, abs=5e-3) and plan.costs[b].b == pytest.approx(slope, abs=2e-3)
        preds = {k: expected_tokens(ALPHA, k) / (a + slope * k) for k in range(1, 6)}
        kb = max(preds, key=lambda x: preds[x])
        assert plan.chosen[b][0] == (kb if preds[kb] >= 1.02 else 0), (b, preds)
    assert plan.chosen[1][0] > plan.chosen[8][0]  # longer drafts at low load
    assert plan.chosen[32][0] == 0  # off where the batch is compute-bound
    assert k_at(plan.schedule, 1) == plan.chosen[1][0] and k_at(plan.schedule, 200) == 0
    # the per-domain choice: code accepts more, so it speculates at least as far at every batch size
    assert all(plan.per_domain["code"][b][0] >= plan.chosen[b][0] for b in truth)
    assert plan.to_json()["schedule"] == plan.schedule
    with pytest.raises(ValueError, match="plain decoding was not measured"):
        make_plan([m for m in measured if m.k > 0], {"all": ALPHA}, 5, 1.02, 256)


def test_eval_recommends_the_built_in_decoders_k() -> None:
    """stage eval's K at batch 1 from its measured cost ratios: the argmax of E_K / (v + K c), plain when none pays."""
    from eval.report import recommend_k

    for v, c in [(1.05, 0.02), (1.1, 0.08), (1.2, 0.3), (1.5, 0.5)]:
        preds = {k: expected_tokens(ALPHA, k) / (v + k * c) for k in range(1, 6)}
        kb = max(preds, key=lambda x: preds[x])
        assert recommend_k(ALPHA, v, c) == ((kb, pytest.approx(preds[kb])) if preds[kb] > 1.0 else (0, 1.0))
    assert recommend_k(ALPHA, 1.05, 0.02)[0] > recommend_k(ALPHA, 1.2, 0.3)[0] > 0  # a cheap draft drafts further
    assert recommend_k(ALPHA, 1.5, 0.5) == (0, 1.0)  # E_1 / (v + c) = 0.85: plain decoding
    assert recommend_k(ALPHA, float("nan"), 0.1)[0] == 0


def test_the_drafter_held_at_k0_is_the_alternative_inside_its_engine() -> None:
    """vLLM runs the draft's first forward even at K=0: the drafter's engine there is slower than plain. The plan
    compares each K with that, not with plain decoding, and records that it speculates somewhere."""
    measured = [served(0, 32, 100.0, 0, 0, ALPHA), served(1, 32, 100.0, 1.5, 0.3, ALPHA)]
    measured.append(served(2, 32, 100.0, 1.5, 0.3, ALPHA))
    k2 = expected_tokens(ALPHA, 2) / 2.1  # 1.0095x plain (K=1: 0.944x)
    idle = Measured(0, 32, 1000, 1000 / 90.0)  # K=0 in the drafter's engine: 0.90x plain
    plan = make_plan(measured, {"all": ALPHA}, 2, 1.02, 64, idle=[idle])
    assert plan.idle_cost[32] == pytest.approx(100 / 90) and plan.idle(32) == pytest.approx(0.9)
    assert plan.chosen[32] == (2, pytest.approx(k2))  # 1.0095 >= 1.02 x 0.90: K=2 beats holding the draft at K=0
    assert plan.predicted("all", 32, 0) == pytest.approx(0.9) and plan.speculates
    no_idle = make_plan(measured, {"all": ALPHA}, 2, 1.02, 64)  # without the K=0 engine: plain is the bar
    assert no_idle.chosen[32] == (0, 1.0) and not no_idle.speculates
    only_two = make_plan(measured, {"all": ALPHA}, 2, 1.02, 64, idle=[idle], allowed=[2])  # a DFlash block: one K
    assert only_two.chosen[32][0] == 2
    one = make_plan(measured, {"all": ALPHA}, 2, 1.02, 64, idle=[idle], allowed=[1])  # 0.944 >= 0.918: still K=1
    assert one.chosen[32] == (1, pytest.approx(expected_tokens(ALPHA, 1) / 1.8))


def test_a_gain_inside_the_calibrations_noise_does_not_turn_speculation_on() -> None:
    measured = [served(0, 4, 100.0, 0, 0, ALPHA), served(1, 4, 100.0, 1.1, 0.4, ALPHA)]
    k1 = expected_tokens(ALPHA, 1) / 1.5  # 1.133x plain
    quiet = make_plan(measured, {"all": ALPHA}, 1, 1.02, 64, noise={4: 0.05})
    assert quiet.chosen[4] == (1, pytest.approx(k1)) and quiet.margin(4) == pytest.approx(1.05)
    noisy = make_plan(measured, {"all": ALPHA}, 1, 1.02, 64, noise={4: 0.2})  # plain moved 20% between repeats
    assert noisy.chosen[4] == (0, 1.0) and not noisy.speculates and noisy.to_json()["noise"] == {"4": 0.2}
