"""Sampling and verification maths for speculative decoding (no model calls).

Everything here works on plain tensors so it can be unit-tested exactly.  There is no
global RNG anywhere: every function that draws random numbers takes an explicit
``torch.Generator``.

References
----------
* Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative Decoding",
  ICML 2023 (arXiv:2211.17192), Algorithm 1 / Theorem 3.5 -- chain verification.
* Chen et al., "Accelerating Large Language Model Decoding with Speculative Sampling",
  2023 (arXiv:2302.01318) -- the same modified rejection sampling.
* Miao et al., "SpecInfer", ASPLOS 2024 (arXiv:2305.09781), Algorithm 2 ("multi-step
  speculative sampling") -- recursive rejection sampling over several candidates, used for
  tree verification.  With deterministic (delta) proposals it reduces to: accept child x
  with probability p(x); on rejection set p(x) = 0, renormalise, try the next child.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from data.modeling import logits_to_probs

if TYPE_CHECKING:
    from eval.tree import DraftTree

logger = logging.getLogger(__name__)

__all__ = [
    "greedy_verify_chain",
    "greedy_walk",
    "logits_to_probs",
    "residual_distribution",
    "sample_from_probs",
    "speculative_verify_chain",
    "uniform",
    "verify_tree",
]

_MASS_EPS = 0.0  # a residual with total mass <= this is treated as empty


def uniform(generator: torch.Generator | None) -> float:
    """One U[0, 1) draw from ``generator``, a CPU ``torch.Generator`` (device-independent streams).

    Raises ``ValueError`` for ``None``: the global RNG is never used.
    """
    if generator is None:
        raise ValueError("sampling needs an explicit (CPU) torch.Generator; the global RNG is not used")
    return float(torch.rand((), generator=generator).item())


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from ``probs[V]`` using ``generator``.

    The draw is done on CPU in float64 with inverse-CDF sampling (one uniform per call), so the
    random stream is identical whatever device/dtype the probabilities come from.
    """
    p = probs.detach().reshape(-1).to("cpu", torch.float64)
    cdf = p.cumsum(0)
    total = float(cdf[-1])
    if not total > 0:
        raise ValueError("cannot sample from a distribution with zero mass")
    # cdf[idx] > u >= cdf[idx - 1]  =>  p[idx] > 0 (cumsum is monotone), so zero-mass tokens are never hit
    idx = int(torch.searchsorted(cdf, uniform(generator) * total, right=True))
    if idx >= p.numel():  # u * total rounded up to total: take the last token with mass
        idx = int(p.nonzero()[-1])
    return idx


def greedy_verify_chain(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy (temperature 0) chain verification -- exact (lossless) w.r.t. greedy decoding.

    Accept draft tokens while they equal the target's argmax; the next token is the target's argmax
    at the first mismatch, or the bonus token after the last draft if all were accepted
    (Leviathan et al., 2023, Sec. 3 with a greedy target).

    Args:
        draft_tokens: ``LongTensor[K]`` (``K`` may be 0).
        target_logits: ``[K + 1, V]`` target logits (or probabilities); row ``i`` is the target's
            prediction after the context plus ``draft_tokens[:i]``.

    Returns:
        ``(n_accepted, next_token)`` with ``0 <= n_accepted <= K``.
    """
    k = int(draft_tokens.numel())
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"target_logits must have K+1={k + 1} rows, got {target_logits.shape[0]}")
    target_argmax = target_logits.argmax(dim=-1).cpu()
    drafts = draft_tokens.reshape(-1).cpu()
    n = 0
    while n < k and int(drafts[n]) == int(target_argmax[n]):
        n += 1
    return n, int(target_argmax[n])


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))``: the distribution to resample from after a rejection.

    (Leviathan et al., 2023, Algorithm 1; Chen et al., 2023, Eq. 1.)  When the residual has zero
    mass (``p <= q`` everywhere, which only happens when ``p == q`` up to rounding) this falls back
    to ``p``; a rejection then has probability zero anyway, so the fallback keeps sampling exact.

    Args:
        p: ``[V]`` target distribution.
        q: ``[V]`` draft (proposal) distribution.

    Returns:
        ``[V]`` float32 distribution.
    """
    p = p.float()
    r = (p - q.float()).clamp_min(0.0)
    mass = r.sum()
    if float(mass) <= _MASS_EPS:
        return p / p.sum()
    return r / mass


def speculative_verify_chain(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Speculative-sampling verification of a chain sampled from the draft -- exact (lossless).

    Leviathan et al. (2023) Algorithm 1 / Chen et al. (2023): draft token ``x_i ~ q_i`` is accepted
    with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection the next token is drawn
    from ``norm(max(0, p_i - q_i))``; if all ``K`` tokens are accepted a bonus token is drawn from
    ``p_K``.  Every emitted token is then distributed exactly as ancestral sampling from ``p``.

    Args:
        draft_tokens: ``LongTensor[K]``, ``x_i`` sampled from ``draft_probs[i]``.
        draft_probs: ``[K, V]`` the draft distributions ``q_i`` the tokens were sampled from.
        target_probs: ``[K + 1, V]`` target distributions ``p_i`` (after the same temperature /
            top-p transform); row ``i`` conditions on the context plus ``draft_tokens[:i]``.
        generator: RNG for the accept tests and the resampling.

    Returns:
        ``(n_accepted, next_token)``.
    """
    k = int(draft_tokens.numel())
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs must have K+1={k + 1} rows, got {target_probs.shape[0]}")
    if draft_probs.shape[0] != k:
        raise ValueError(f"draft_probs must have K={k} rows, got {draft_probs.shape[0]}")
    drafts = draft_tokens.reshape(-1).to(target_probs.device)
    rows = torch.arange(k, device=target_probs.device)
    p_x = target_probs[rows, drafts].tolist()
    q_x = draft_probs.to(target_probs.device)[rows, drafts].tolist()
    for i in range(k):
        # accept iff u < p/q  <=>  u * q < p  (also correct if q_x == 0: accept iff p_x > 0)
        if uniform(generator) * q_x[i] < p_x[i]:
            continue
        return i, sample_from_probs(
            residual_distribution(target_probs[i], draft_probs[i].to(target_probs.device)), generator
        )
    return k, sample_from_probs(target_probs[k], generator)


def children_lists(parents: list[int], n_nodes: int) -> list[list[int]]:
    """children[j + 1] = child indices of node j (children[0] = children of the root), in order."""
    kids: list[list[int]] = [[] for _ in range(n_nodes + 1)]
    for i, par in enumerate(parents):
        kids[par + 1].append(i)
    return kids


def greedy_walk(
    tokens: list[int], kids: list[list[int]], target_next: Callable[[int, int], int]
) -> tuple[list[int], int]:
    """Greedy verification walk shared by the decoder and replay evaluation.

    From the root, descend into the (first) child whose token equals the target's greedy next token, until
    none does; that token is the next (bonus / correction) token. ``target_next(node, depth)`` gives the
    target's argmax after ``node`` (-1 = the root), which sits at ``depth`` (0 = the root) on the path; it is
    only ever asked for the root and for accepted nodes, i.e. along the path the target itself would write.

    Returns:
        ``(accepted node indices along the path, next token)``.
    """
    accepted: list[int] = []
    node = -1
    while True:
        want = int(target_next(node, len(accepted)))
        nxt = next((c for c in kids[node + 1] if tokens[c] == want), None)
        if nxt is None:
            return accepted, want
        accepted.append(nxt)
        node = nxt


def verify_tree(
    tree: DraftTree,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    greedy: bool = False,
) -> tuple[list[int], int]:
    """Verify a draft tree against the target in one go -- exact (lossless).

    Args:
        tree: the draft tree with ``N`` nodes (see :class:`eval.tree.DraftTree`).
        target_probs: ``[N + 1, V]``; row 0 is the target distribution after the root (the last
            committed token), row ``i + 1`` the distribution after node ``i`` (i.e. conditioned
            on the path root -> node ``i``).  In greedy mode logits are fine too (only argmax).
        generator: RNG (required unless ``greedy``).
        greedy: temperature-0 verification.

    Greedy: walk from the root; at each node descend into the (first) child whose token equals the
    target's argmax; stop when none does; the next token is that argmax.

    Sampling: recursive rejection sampling (SpecInfer, Miao et al. 2024, Alg. 2).  At a node with
    current target distribution ``p``, its children are tried in order.  Child ``c`` with token
    ``x`` and proposal ``q_c`` is accepted with probability ``min(1, p(x) / q_c(x))``; on rejection
    ``p <- norm(max(0, p - q_c))`` and the next child is tried; if no child is accepted the next
    token is sampled from the remaining ``p``.  The proposal of a node is:

    * ``tree.draft_probs[c]`` when given -- the node was SAMPLED from that distribution
      (independently of its siblings);
    * otherwise a delta on its token -- deterministic children such as top-k expansions.  Then the
      accept probability is ``p(x)`` and the residual is ``p`` with ``p(x) = 0``, renormalised.

    A chain with ``draft_probs`` is delegated to :func:`speculative_verify_chain` (identical maths).

    Returns:
        ``(accepted, next_token)`` where ``accepted`` lists the accepted node indices along the path
        from the root (``len(accepted)`` = number of accepted draft tokens).
    """
    n = len(tree.parents)
    if target_probs.shape[0] != n + 1:
        raise ValueError(f"target_probs must have N+1={n + 1} rows, got {target_probs.shape[0]}")
    tokens = tree.tokens.reshape(-1).cpu().tolist()
    kids = children_lists(tree.parents, n)

    if greedy:
        argmax = target_probs.argmax(dim=-1).cpu().tolist()
        return greedy_walk(tokens, kids, lambda node, _depth: int(argmax[node + 1]))

    if tree.draft_probs is not None and tree.is_chain():
        n_acc, nxt_tok = speculative_verify_chain(tree.tokens, tree.draft_probs, target_probs, generator)
        return list(range(n_acc)), nxt_tok

    p_all = target_probs.detach().float().cpu()
    q_all = tree.draft_probs.detach().float().cpu() if tree.draft_probs is not None else None
    accepted = []
    node = -1
    while True:
        p = p_all[node + 1].clone()
        p = p / p.sum()
        chosen: int | None = None
        for c in kids[node + 1]:
            x = tokens[c]
            u = uniform(generator)
            if q_all is None:
                # delta proposal: accept with p(x); residual = p without x
                if u < float(p[x]):
                    chosen = c
                    break
                p[x] = 0.0
                mass = float(p.sum())
                # zero mass is only reachable through rounding (a rejection had probability ~0)
                p = p / mass if mass > _MASS_EPS else p_all[node + 1] / p_all[node + 1].sum()
            else:
                q = q_all[c]
                if u * float(q[x]) < float(p[x]):
                    chosen = c
                    break
                p = residual_distribution(p, q)
        if chosen is None:
            return accepted, sample_from_probs(p, generator)
        accepted.append(chosen)
        node = chosen
