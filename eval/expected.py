"""Expected acceptance of a sampling chain drafter along a sampled path, from the target's and the drafter's
distributions (decode mode's ``expected_tau``; replay's sampled walk is :mod:`eval.replay`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from data.target import output_head
from eval.proposers.base import Proposer, TargetOutput
from eval.replay import hidden_rows
from eval.sampling import logits_to_probs
from eval.traces import trace_target

__all__ = ["ExpectedAcceptance", "expected_acceptance"]


@dataclass
class ExpectedAcceptance:
    """Expected counters of a sampled speculative generation along one path (see :func:`expected_acceptance`).

    Attributes:
        steps: expected number of verification steps.
        tokens: tokens those steps emit (the path length minus the prefill's token).
        attempted / accepted: expected number of steps that verify / accept draft position ``j + 1``.
    """

    steps: float
    tokens: int
    attempted: list[float]
    accepted: list[float]

    def tau(self) -> float:
        return self.tokens / self.steps if self.steps > 0 else math.nan

    def alpha(self) -> list[float]:
        return [a / t if t > 0 else math.nan for a, t in zip(self.accepted, self.attempted, strict=True)]

    @staticmethod
    def pooled_tau(items: Sequence[ExpectedAcceptance]) -> float:
        steps = sum(x.steps for x in items)
        return sum(x.tokens for x in items) / steps if steps > 0 else math.nan


@torch.inference_mode()
def expected_acceptance(
    proposer: Proposer,
    target_model: torch.nn.Module,
    prompt: Sequence[int],
    path: Sequence[int],
    temperature: float,
    top_p: float,
    generator: torch.Generator,
) -> ExpectedAcceptance:
    """Expected acceptance of a sampling chain drafter, from the target's and the drafter's distributions along
    one sampled path (no decoding).

    ``path`` is a continuation sampled from the target at ``temperature`` / ``top_p`` (e.g. plain decoding's
    output: lossless speculative sampling emits text distributed exactly like it). At every position ``t`` of the
    path the drafter drafts a chain in sampling mode from the committed prefix, with proposal distributions
    ``q_1..q_K``; with ``p_j`` the target's distribution after the path's first ``t + j - 1`` tokens, the chance
    that draft position ``j`` is accepted given the earlier ones is ``beta_j(t) = sum_x min(p_j(x), q_j(x))``
    (Leviathan et al. 2023, Sec. 3: one minus the total variation distance). A step starting at ``t`` then emits
    ``m`` tokens with probability ``prod_{j<m} beta_j(t) (1 - beta_m(t))`` (the chain cut to the remaining budget
    as the decoder cuts it), and the probability that a step starts at ``t`` follows by dynamic programming from
    the first step (right after the prefill token). Expected steps, and expected attempts / acceptances per draft
    position, are sums over ``t`` weighted by that probability.

    Deeper positions are read with teacher forcing: the drafter drafts the path's own tokens
    (:attr:`Proposer.forced_tokens`), so ``q_j`` and ``p_j`` are both conditioned on the path. Exact for position 1;
    for deeper ones it takes the accepted drafts to be distributed like the target's own samples (they are
    distributed like ``min(p, q)`` renormalised). On a draft/target pair with alpha ~0.8 it matched the sampled
    decoder's tau to within 1.5% (tests/test_eval/test_replay.py); reading ``q_j`` after the drafter's own sampled
    tokens instead was 5-9% low.
    """
    need = proposer.needs_hidden_states
    layers = proposer.aux_hidden_layers
    trace = trace_target(target_model, prompt, list(path), layers, need_hidden=True)
    assert trace.hidden is not None
    lm_head = output_head(target_model)

    def p_after(pos: int) -> torch.Tensor:  # the target's distribution after the token at sequence position pos
        return logits_to_probs(lm_head(trace.hidden["last"][pos][None])[0].float(), temperature, top_p)

    T = int(trace.prompt.numel())
    N = len(path)
    seq = torch.cat([trace.prompt, torch.tensor(list(path), dtype=trace.prompt.dtype, device=trace.prompt.device)])
    proposer.setup(temperature, top_p, generator)
    prompt_rows = hidden_rows(trace.hidden, layers, slice(0, T)) if need else None
    proposer.begin(trace.prompt, TargetOutput(trace.prompt_logits, prompt_rows))
    betas: dict[int, list[float]] = {}
    for n in range(1, N):  # the context holds n path tokens; the root is seq[T + n - 1]
        L = T + n
        proposer.forced_tokens = [int(t) for t in path[n:]]  # teacher forcing: draft the path's own tokens
        try:
            tree = proposer.propose(seq[:L]).truncate_depth(N - n - 1)
        finally:
            proposer.forced_tokens = None
        if len(tree) and (tree.draft_probs is None or not tree.is_chain()):
            raise ValueError(f"{proposer.name}: expected acceptance needs a sampled chain draft (draft_probs)")
        betas[n] = [
            float(torch.minimum(p_after(L - 1 + j), tree.draft_probs[j].float().to(seq.device)).sum())  # type: ignore[index]
            for j in range(len(tree))
        ]
        proposer.commit(seq[: L + 1], 1, hidden_rows(trace.hidden, layers, slice(L - 1, L)) if need else None)
    start = [0.0] * (N + 1)
    if N > 1:
        start[1] = 1.0
    depth = max((len(b) for b in betas.values()), default=0)
    attempted, accepted = [0.0] * depth, [0.0] * depth
    for n in range(1, N):
        w = start[n]
        if w == 0.0:
            continue
        reach = 1.0  # P(all earlier positions accepted)
        for j, beta in enumerate(betas[n]):
            attempted[j] += w * reach
            accepted[j] += w * reach * beta
            start[n + j + 1] += w * reach * (1.0 - beta)  # j accepted, position j + 1 rejected: emits j + 1
            reach *= beta
        start[min(N, n + len(betas[n]) + 1)] += w * reach  # the whole chain accepted, plus the bonus
    return ExpectedAcceptance(sum(start[1:N]), max(0, N - 1), attempted, accepted)
