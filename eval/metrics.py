"""Decoding statistics: acceptance length tau, per-position acceptance alpha_i, speed-up model.

Conventions (used everywhere in this repo):

* **acceptance length tau** = tokens emitted per target verification forward pass, *bonus token
  included*: a step that accepts ``a`` draft tokens emits ``a + 1`` tokens, so ``tau >= 1`` and plain
  decoding has ``tau = 1``.  This is the convention of EAGLE (Li et al., 2024) and Medusa (Cai et al.,
  2024) ("average acceptance length"); the target prefill is NOT a verification step.
* **alpha_i** = P(draft position i accepted | positions 1..i-1 accepted and a position-i token was
  proposed), estimated as ``accepted_per_position[i-1] / attempted_per_position[i-1]``.  For trees,
  "position" means depth, and position i counts as attempted when the accepted path reached depth
  ``i - 1`` and the node there had at least one child.

Speed-up model: Leviathan et al., "Fast Inference from Transformers via Speculative Decoding",
ICML 2023 (arXiv:2211.17192), Sec. 3.3 -- see :func:`predicted_speedup`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["DecodeStats", "expected_tokens_per_step", "predicted_speedup"]


def _add_lists(a: list[int], b: Sequence[int]) -> list[int]:
    out = list(a) + [0] * max(0, len(b) - len(a))
    for i, v in enumerate(b):
        out[i] += int(v)
    return out


@dataclass
class DecodeStats:
    """Counters collected by a decoder (one or several generations, see :meth:`merge`).

    Attributes:
        target_forwards: target forward passes including the prefill(s).
        prefill_forwards: how many of those were prefills.
        new_tokens: tokens returned to the caller (after eos / max_new_tokens truncation).
        accepted_lengths: accepted draft tokens per verification step (bonus token excluded).
        accepted_per_position: ``[i]`` = steps where draft position ``i + 1`` was accepted.
        attempted_per_position: ``[i]`` = steps where draft position ``i + 1`` was verified
            (all earlier positions accepted and a token proposed there).
        draft_tokens_proposed: draft nodes sent to verification (all tree nodes counted).
        draft_time_s / target_time_s / total_time_s: wall times (``time.perf_counter``).
        n_sequences: number of generations aggregated.
    """

    target_forwards: int = 0
    prefill_forwards: int = 0
    new_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    attempted_per_position: list[int] = field(default_factory=list)
    draft_tokens_proposed: int = 0
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    total_time_s: float = 0.0
    n_sequences: int = 0

    @property
    def target_forwards_excl_prefill(self) -> int:
        """Verification forwards (= target forwards minus prefills)."""
        return self.target_forwards - self.prefill_forwards

    @property
    def verify_steps(self) -> int:
        """Number of verification steps recorded."""
        return len(self.accepted_lengths)

    def record_step(self, n_accepted: int, attempted_depth: int, n_proposed: int) -> None:
        """Record one verification step.

        Args:
            n_accepted: accepted draft tokens ``a`` (bonus excluded).
            attempted_depth: deepest position verified: ``a + 1`` if the last accepted node (or the
                root) had a child, else ``a``.
            n_proposed: number of draft nodes in the verified tree.
        """
        if not n_accepted <= attempted_depth <= n_accepted + 1:
            raise ValueError(f"attempted_depth {attempted_depth} inconsistent with {n_accepted} accepted")
        self.accepted_lengths.append(int(n_accepted))
        self.accepted_per_position = _add_lists(self.accepted_per_position, [1] * n_accepted)
        self.attempted_per_position = _add_lists(self.attempted_per_position, [1] * attempted_depth)
        self.draft_tokens_proposed += int(n_proposed)

    def tau(self) -> float:
        """Acceptance length tau: mean tokens emitted per verification forward, bonus token included.

        ``tau = mean_steps(accepted + 1)``; NaN when no verification step was recorded.  Computed
        from the verdicts, i.e. before the final eos / max_new_tokens truncation.
        """
        if not self.accepted_lengths:
            return math.nan
        return sum(a + 1 for a in self.accepted_lengths) / len(self.accepted_lengths)

    def alpha(self) -> list[float]:
        """Per-position acceptance rates ``alpha_i = P(pos i accepted | pos i-1 accepted)``, i = 1.."""
        acc = self.accepted_per_position + [0] * (len(self.attempted_per_position) - len(self.accepted_per_position))
        return [a / t if t else math.nan for a, t in zip(acc, self.attempted_per_position, strict=True)]

    def tokens_per_target_forward(self, include_prefill: bool = False) -> float:
        """``new_tokens / target forwards`` (the "tau_HF" view: truncation and prefill token included)."""
        denom = self.target_forwards if include_prefill else self.target_forwards_excl_prefill
        return self.new_tokens / denom if denom else math.nan

    def merge(self, *others: DecodeStats) -> DecodeStats:
        """Aggregate several stats into a new object (sums; step lists concatenated)."""
        out = DecodeStats(**asdict(self))
        for o in others:
            out.target_forwards += o.target_forwards
            out.prefill_forwards += o.prefill_forwards
            out.new_tokens += o.new_tokens
            out.accepted_lengths = out.accepted_lengths + list(o.accepted_lengths)
            out.accepted_per_position = _add_lists(out.accepted_per_position, o.accepted_per_position)
            out.attempted_per_position = _add_lists(out.attempted_per_position, o.attempted_per_position)
            out.draft_tokens_proposed += o.draft_tokens_proposed
            out.draft_time_s += o.draft_time_s
            out.target_time_s += o.target_time_s
            out.total_time_s += o.total_time_s
            out.n_sequences += o.n_sequences
        return out

    @staticmethod
    def merge_all(stats: Iterable[DecodeStats]) -> DecodeStats:
        """Merge an iterable of stats (empty -> zero stats)."""
        items = list(stats)
        if not items:
            return DecodeStats()
        return items[0].merge(*items[1:])

    def to_dict(self) -> dict[str, Any]:
        """Raw counters plus derived metrics (tau, alpha, throughput), JSON-serialisable."""
        d: dict[str, Any] = asdict(self)
        d["target_forwards_excl_prefill"] = self.target_forwards_excl_prefill
        d["verify_steps"] = self.verify_steps
        d["tau"] = self.tau()
        d["alpha"] = self.alpha()
        d["tokens_per_target_forward"] = self.tokens_per_target_forward()
        d["tokens_per_s"] = self.new_tokens / self.total_time_s if self.total_time_s > 0 else math.nan
        return d


def expected_tokens_per_step(alphas: float | Sequence[float], k: int) -> float:
    """Expected tokens emitted per verification step for a chain of ``k`` drafts.

    ``E[tokens] = 1 + sum_{i=1..k} prod_{j<=i} alpha_j`` (Leviathan et al., 2023, Eq. 1 generalised
    to per-position rates; with a constant alpha it equals ``(1 - alpha^(k+1)) / (1 - alpha)``).
    """
    if k < 0:
        raise ValueError("k must be >= 0")
    al = [float(alphas)] * k if isinstance(alphas, int | float) else [float(a) for a in alphas]
    if len(al) < k:
        raise ValueError(f"need at least k={k} per-position alphas, got {len(al)}")
    total, prod = 1.0, 1.0
    for a in al[:k]:
        prod *= a
        total += prod
    return total


def predicted_speedup(alphas: float | Sequence[float], c: float, k: int) -> float:
    """Predicted wall-clock speed-up over plain decoding (Leviathan et al., 2023, Thm. 3.8).

    ``speedup = E[tokens per step] / (1 + k * c)`` with ``E`` from :func:`expected_tokens_per_step`,
    where ``c`` = cost of one draft forward relative to one target forward and a step costs ``k``
    draft forwards plus one target forward (verification of ``k + 1`` positions assumed to cost
    the same as one decoding forward).
    """
    if c < 0:
        raise ValueError("c must be >= 0")
    return expected_tokens_per_step(alphas, k) / (1.0 + k * c)
