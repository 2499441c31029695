"""Tests of eval.metrics."""

from __future__ import annotations

import json
import math

import pytest

from eval.metrics import DecodeStats, expected_tokens_per_step, predicted_speedup


def _stats() -> DecodeStats:
    s = DecodeStats(target_forwards=5, prefill_forwards=1, new_tokens=9, n_sequences=1)
    # K = 3 chain: accepted 3 (all), 0, 1, 2
    s.record_step(3, 3, 3)
    s.record_step(0, 1, 3)
    s.record_step(1, 2, 3)
    s.record_step(2, 3, 3)
    return s


def test_tau_counts_bonus_token() -> None:
    s = _stats()
    assert s.tau() == pytest.approx((4 + 1 + 2 + 3) / 4)
    assert math.isnan(DecodeStats().tau())
    assert s.target_forwards_excl_prefill == 4 and s.verify_steps == 4
    assert s.tokens_per_target_forward() == pytest.approx(9 / 4)
    assert s.tokens_per_target_forward(include_prefill=True) == pytest.approx(9 / 5)


def test_alpha_is_conditional_per_position() -> None:
    s = _stats()
    assert s.accepted_per_position == [3, 2, 1]
    assert s.attempted_per_position == [4, 3, 2]
    assert s.alpha() == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    # a position attempted but never accepted has alpha 0 (not NaN)
    t = DecodeStats()
    t.record_step(0, 1, 2)
    assert t.alpha() == [0.0]
    with pytest.raises(ValueError):
        t.record_step(2, 1, 2)


def test_merge_and_to_dict() -> None:
    a, b = _stats(), DecodeStats(target_forwards=2, prefill_forwards=1, new_tokens=2, n_sequences=1)
    b.record_step(0, 1, 5)
    b.draft_time_s = 0.5
    m = a.merge(b)
    assert m.accepted_lengths == [3, 0, 1, 2, 0]
    assert m.attempted_per_position == [5, 3, 2] and m.accepted_per_position == [3, 2, 1]
    assert m.target_forwards == 7 and m.prefill_forwards == 2 and m.new_tokens == 11 and m.n_sequences == 2
    assert m.draft_tokens_proposed == 17 and m.draft_time_s == 0.5
    assert a.accepted_lengths == [3, 0, 1, 2]  # inputs untouched
    assert DecodeStats.merge_all([a, b]).to_dict() == m.to_dict()
    d = m.to_dict()
    assert d["tau"] == pytest.approx(m.tau()) and d["alpha"] == pytest.approx(m.alpha())
    json.dumps(d)


def test_predicted_speedup_leviathan() -> None:
    # constant alpha: E = (1 - a^(k+1)) / (1 - a)
    a, k, c = 0.7, 4, 0.1
    assert expected_tokens_per_step(a, k) == pytest.approx((1 - a ** (k + 1)) / (1 - a))
    assert predicted_speedup(a, c, k) == pytest.approx((1 - a ** (k + 1)) / ((1 - a) * (1 + k * c)))
    # per-position alphas: 1 + a1 + a1 a2 + a1 a2 a3
    assert expected_tokens_per_step([0.8, 0.5, 0.5], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    assert predicted_speedup([0.8, 0.5, 0.5, 0.9], 0.0, 2) == pytest.approx(1 + 0.8 + 0.4)
    assert predicted_speedup(0.9, 0.2, 0) == 1.0
    with pytest.raises(ValueError):
        expected_tokens_per_step([0.5], 2)
