"""The serving cost model: which K (draft tokens per step) pays at which batch size, from measured costs.

A speculative step of K draft tokens at batch size B costs ``a(B) + b(B) K`` plain decoding steps of the same
batch: ``a`` is the verification pass plus the engine's fixed speculation overhead, ``b`` the price of one drafted
token (its draft forward and its extra verification row). Both are fitted by least squares, per batch size, to the
step costs measured in the serving engine, each ``mean acceptance length x plain tokens/s / speculative tokens/s``
(a step emits the mean acceptance length of tokens per request; a plain step emits one).

A chain of K drafts emits ``E_K = 1 + sum_{i<=K} prod_{j<=i} alpha_j`` tokens per step (alpha_j: the conditional
per-position acceptance rates, from the replay eval or the engine's counters), so the predicted throughput at
(B, K) is ``plain tokens/s(B) x E_K / (a(B) + b(B) K)`` (Leviathan et al., 2023, Thm. 3.8, with a measured cost
instead of an assumed one). The schedule takes, per measured batch size, the K with the highest prediction, and K=0
(speculation off) unless that prediction beats plain decoding by ``min_gain``; between two measured batch sizes it
keeps the smaller of their two K (acceptance does not change with B, and a step's cost only grows with it), and
above the largest measured size it turns speculation off: a schedule never guesses where it has not measured.

Pure Python: no torch, no engine. :mod:`eval.vllm_serve` measures; ``stage=deploy`` (train/deploy.py) writes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Measured:
    """One engine configuration served at one concurrency: what the engine produced and counted."""

    k: int
    """Draft tokens per step (0: plain decoding)."""
    batch: int
    generated: int
    seconds: float
    drafts: int = 0
    """Draft proposals (one per request per speculative step)."""
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=list)
    """Accepted drafts per chain position (vLLM's ``spec_decode_num_accepted_tokens_per_pos``)."""

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.seconds if self.seconds > 0 else math.nan

    @property
    def k_served(self) -> float:
        """Draft tokens per proposal the engine really made (under a schedule: the mean over its batch sizes)."""
        return self.draft_tokens / self.drafts if self.drafts else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a request gains per engine step (1 for plain decoding), as vLLM reports it."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0


@dataclass
class StepCost:
    """``step = a + b K`` plain steps at one batch size, and the points it was fitted to."""

    a: float
    b: float
    points: dict[int, float]
    """K -> measured step cost in plain steps."""

    def __call__(self, k: int) -> float:
        return 1.0 if k == 0 else self.a + self.b * k


def step_cost(plain: Measured, spec: Measured) -> float:
    """A speculative step's cost in plain steps at the same batch size: tokens per step over the throughput ratio."""
    if not (plain.tokens_per_s > 0 and spec.tokens_per_s > 0):
        raise ValueError(f"no throughput measured at batch {plain.batch} (plain or K={spec.k})")
    return spec.mean_acceptance_length * plain.tokens_per_s / spec.tokens_per_s


def fit_step_cost(points: Mapping[int, float]) -> StepCost:
    """Least squares ``cost = a + b K`` over the measured K (one K: ``a = 1``, the verification pass costing a plain
    step). ``b`` is held at >= 0: a drafted token never makes a step cheaper, and a negative slope is noise."""
    if not points:
        raise ValueError("no speculative configuration measured")
    ks = sorted(points)
    if len(ks) == 1:
        a = 1.0
        b = max(0.0, (points[ks[0]] - a) / ks[0])
        return StepCost(a, b, dict(points))
    n = len(ks)
    mk = sum(ks) / n
    mc = sum(points[k] for k in ks) / n
    b = sum((k - mk) * (points[k] - mc) for k in ks) / sum((k - mk) ** 2 for k in ks)
    if b < 0:
        b = 0.0
    return StepCost(mc - b * mk, b, dict(points))


def fit_costs(measured: Sequence[Measured]) -> dict[int, StepCost]:
    """The cost model per batch size from every (plain, K) pair measured at it."""
    by_batch: dict[int, dict[int, Measured]] = {}
    for m in measured:
        by_batch.setdefault(m.batch, {})[m.k] = m
    out: dict[int, StepCost] = {}
    for batch, ms in sorted(by_batch.items()):
        if 0 not in ms:
            raise ValueError(f"batch {batch}: plain decoding was not measured (the baseline of every cost)")
        pts = {k: step_cost(ms[0], m) for k, m in ms.items() if k > 0}
        if pts:
            out[batch] = fit_step_cost(pts)
    return out


def expected_tokens(alpha: Sequence[float], k: int) -> float:
    """Tokens per step of a chain of ``k`` drafts with conditional per-position acceptance ``alpha``."""
    total, prod = 1.0, 1.0
    for a in list(alpha)[:k]:
        prod *= 0.0 if a is None or math.isnan(a) else float(a)
        total += prod
    return total


def alpha_from_counts(drafts: int, per_pos: Sequence[int]) -> list[float]:
    """Conditional per-position acceptance from an engine's counters (accepted at position i over accepted at i-1)."""
    out: list[float] = []
    prev = drafts
    for n in per_pos:
        out.append(n / prev if prev else 0.0)
        prev = n
    return out


def predicted_ratio(alpha: Sequence[float], cost: StepCost, k: int) -> float:
    """Predicted throughput at K over plain decoding's at the same batch size."""
    return expected_tokens(alpha, k) / cost(k) if k else 1.0


def best_k(
    alpha: Sequence[float], cost: StepCost, ks: Sequence[int], min_gain: float, idle: float = 1.0
) -> tuple[int, float]:
    """(K, predicted ratio to plain) maximising the prediction over ``ks``, or (0, ``idle``) unless it beats
    ``min_gain`` times the K=0 option. ``idle`` is the K=0 ratio of the engine that serves the drafter (vLLM still
    runs the draft's first forward at K=0, to keep its KV cache: below 1.0 there); 1.0 for plain decoding."""
    preds = {k: predicted_ratio(alpha, cost, k) for k in ks if k > 0}
    if not preds:
        return 0, idle
    k = max(preds, key=lambda x: (preds[x], -x))  # ties: the smaller K (less work for the same tokens)
    return (k, preds[k]) if preds[k] >= min_gain * idle else (0, idle)


def schedule_from(ks: Mapping[int, int], max_batch: int) -> list[list[int]]:
    """vLLM's ``num_speculative_tokens_per_batch_size``: inclusive ``[lo, hi, K]`` ranges from batch 1 to
    ``max_batch``. Measured sizes keep their K; sizes between two measured ones the smaller K of the two; sizes
    below the first measured one its K; above the last measured one K=0. Adjacent ranges with one K merge."""
    if not ks:
        return [[1, max_batch, 0]]
    sizes = sorted(ks)
    dense: list[tuple[int, int, int]] = []
    for i, b in enumerate(sizes):
        lo = 1 if i == 0 else b
        dense.append((lo, b, ks[b]))
        if i + 1 < len(sizes) and sizes[i + 1] > b + 1:
            dense.append((b + 1, sizes[i + 1] - 1, min(ks[b], ks[sizes[i + 1]])))
    if sizes[-1] < max_batch:
        dense.append((sizes[-1] + 1, max_batch, 0))
    merged: list[list[int]] = []
    for lo, hi, k in dense:
        if lo > max_batch:
            break
        hi = min(hi, max_batch)
        if merged and merged[-1][2] == k and merged[-1][1] + 1 == lo:
            merged[-1][1] = hi
        else:
            merged.append([lo, hi, k])
    return merged


def k_at(schedule: Sequence[Sequence[int]], batch: int) -> int:
    """The K a schedule gives batch size ``batch`` (0 outside every range)."""
    for lo, hi, k in schedule:
        if lo <= batch <= hi:
            return int(k)
    return 0


@dataclass
class Plan:
    """What the cost model recommends, with everything it was derived from."""

    costs: dict[int, StepCost]
    plain_tokens_per_s: dict[int, float]
    alpha: dict[str, list[float]]
    """Acceptance per domain; ``all`` is the mix the global schedule is chosen for."""
    k_max: int
    min_gain: float
    idle_cost: dict[int, float] = field(default_factory=dict)
    """batch -> the cost of a step at K=0 in an engine that holds the drafter, in plain steps (measured; 1.0 where
    not measured)."""
    noise: dict[int, float] = field(default_factory=dict)
    """batch -> how much plain decoding's throughput moved between the calibration's repeats (relative)."""
    chosen: dict[int, tuple[int, float]] = field(default_factory=dict)
    """batch -> (K, predicted ratio) for the ``all`` mix."""
    per_domain: dict[str, dict[int, tuple[int, float]]] = field(default_factory=dict)
    schedule: list[list[int]] = field(default_factory=list)

    def margin(self, batch: int) -> float:
        """How much a K must beat the drafter's engine at K=0 by, at this batch size."""
        return max(self.min_gain, 1.0 + self.noise.get(batch, 0.0))

    def idle(self, batch: int) -> float:
        """Throughput ratio to plain of the drafter's engine at K=0."""
        return 1.0 / self.idle_cost.get(batch, 1.0)

    def predicted(self, domain: str, batch: int, k: int) -> float:
        """Predicted ratio to plain of domain ``domain`` served with K at ``batch`` by the drafter's engine."""
        return predicted_ratio(self.alpha[domain], self.costs[batch], k) if k else self.idle(batch)

    @property
    def speculates(self) -> bool:
        """Whether any measured load gets K > 0 (else: serve without the drafter)."""
        return any(k for k, _ in self.chosen.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "step_cost": {str(b): {"a": c.a, "b": c.b, "measured": c.points} for b, c in self.costs.items()},
            "plain_tokens_per_s": {str(b): v for b, v in self.plain_tokens_per_s.items()},
            "alpha": self.alpha,
            "k_max": self.k_max,
            "min_gain": self.min_gain,
            "idle_cost": {str(b): v for b, v in self.idle_cost.items()},
            "noise": {str(b): v for b, v in self.noise.items()},
            "chosen": {str(b): {"k": k, "predicted_vs_plain": r} for b, (k, r) in self.chosen.items()},
            "per_domain": {
                d: {str(b): {"k": k, "predicted_vs_plain": r} for b, (k, r) in ch.items()}
                for d, ch in self.per_domain.items()
            },
            "schedule": self.schedule,
        }


def make_plan(
    measured: Sequence[Measured],
    alpha: Mapping[str, Sequence[float]],
    k_max: int,
    min_gain: float,
    max_batch: int,
    idle: Sequence[Measured] = (),
    allowed: Sequence[int] | None = None,
    noise: Mapping[int, float] | None = None,
) -> Plan:
    """Fit the costs, choose K per measured batch size for the ``all`` mix (and per domain, for the report) and
    build the schedule. ``idle``: the drafter's engine served at K=0 (its cost per batch size); ``allowed``: the K
    the drafter can be served with (default 1..k_max); ``noise``: per batch size, how much plain decoding's
    throughput moved between repeats (relative): a K must then beat the K=0 option by at least that much too
    (``max(min_gain, 1 + noise)``), so a gain the calibration cannot resolve never turns speculation on."""
    if "all" not in alpha:
        raise ValueError("the acceptance mix 'all' is missing")
    costs = fit_costs(measured)
    plain = {m.batch: m for m in measured if m.k == 0}
    idle_cost = {m.batch: plain[m.batch].tokens_per_s / m.tokens_per_s for m in idle if m.batch in plain}
    plan = Plan(
        costs, {b: m.tokens_per_s for b, m in plain.items()}, {d: list(a) for d, a in alpha.items()}, k_max, min_gain
    )
    plan.idle_cost = idle_cost
    plan.noise = dict(noise or {})
    ks = sorted(allowed) if allowed is not None else list(range(1, k_max + 1))
    for d, al in plan.alpha.items():
        ch = {b: best_k(al, c, ks, plan.margin(b), plan.idle(b)) for b, c in costs.items()}
        if d == "all":
            plan.chosen = ch
        else:
            plan.per_domain[d] = ch
    plan.schedule = schedule_from({b: k for b, (k, _) in plan.chosen.items()}, max_batch)
    return plan
