"""Proposer for Medusa heads (Cai et al., "Medusa", ICML 2024, arXiv:2401.10774).

Medusa head ``k`` (1-based) maps the target's final hidden state at position ``t`` (the LM head's input) to
a distribution over token ``t + k + 1``. After every verification step the proposer keeps only the newest
committed row (the hidden state of ``context[-2]``); the root of the next draft is ``context[-1]`` (predicted
by the target's own LM head), so head ``k``'s logits at that row give the draft at depth ``k``. The heads do
not see the drafted tokens: every node at depth ``k`` draws from the same distribution of head ``k``.

* ``decode=chain``: ``min(chain_k, num_heads)`` tokens, head ``k``'s argmax (at temperature > 0 a sample
  from ``q_k``, recorded for lossless speculative sampling).
* ``decode=tree``: a static Medusa tree of top-k rank paths, ``tree_paths`` if given, else
  :func:`default_tree_paths` from the heads' measured per-rank accuracies. Static trees are deterministic
  (delta proposals), so verification stays lossless at any temperature.

Exact (lossless) with any heads, trained or not: the target verifies every draft token.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

import torch

from eval.config import Decode
from eval.proposers.base import Proposer, TargetOutput
from eval.tree import DraftTree, chain, empty_tree, static_tree, static_tree_paths_to_parents, tree_depths

__all__ = ["MedusaProposer", "default_tree_paths", "rank_prior"]


def rank_prior(num_heads: int, top_k: int) -> torch.Tensor:
    """The per-head rank accuracies assumed before anything was measured: ``0.6**k / (r + 1)**2``.

    Decreasing in the head index ``k`` (1-based) and in the rank ``r`` (0-based), so an untrained drafter
    still gets a sensible tree (deep along the top-1 ranks, wide near the root)."""
    k = torch.arange(1, num_heads + 1, dtype=torch.float64)[:, None]
    r = torch.arange(top_k, dtype=torch.float64)[None, :]
    return 0.6**k / (r + 1) ** 2


def default_tree_paths(accuracy: torch.Tensor, total_tokens: int, depth: int, top_k: int) -> list[list[int]]:
    """Medusa's greedy static tree: the ``total_tokens`` rank paths with the highest expected acceptance.

    ``accuracy[k - 1, r]`` is the probability that head ``k``'s rank-``r`` token is the right one. A path
    ``(r_1, ..., r_d)`` (node at depth ``d``) is accepted with probability ``prod_i accuracy[i - 1, r_i]``
    (heads treated as independent), which is also its contribution to the expected acceptance length. Nodes
    are added in decreasing order of that value; a child's value never exceeds its parent's, and a child
    only becomes a candidate once its parent is in, so the result is closed under prefixes. Ties go to
    the shorter, then lexicographically smaller path (deterministic).

    Args:
        accuracy: ``[K, R]`` per-head, per-rank accuracies in ``[0, 1]``.
        total_tokens: nodes in the tree (fewer if the candidate space is smaller).
        depth: deepest node allowed (capped at ``K``).
        top_k: largest rank + 1 allowed (capped at ``R``).

    Returns:
        Rank paths in the order they were chosen (parents first), for :func:`eval.tree.static_tree`.
    """
    acc = accuracy.detach().double().cpu().tolist()
    depth = min(depth, len(acc))
    top_k = min(top_k, len(acc[0]) if acc else 0)
    if depth < 1 or top_k < 1 or total_tokens < 1:
        return []
    heap: list[tuple[float, int, tuple[int, ...]]] = [(-acc[0][r], 1, (r,)) for r in range(top_k)]
    heapq.heapify(heap)
    out: list[list[int]] = []
    while heap and len(out) < total_tokens:
        neg_value, d, path = heapq.heappop(heap)
        out.append(list(path))
        if d < depth:
            for r in range(top_k):
                heapq.heappush(heap, (neg_value * acc[d][r], d + 1, (*path, r)))
    return out


class MedusaProposer(Proposer):
    """Drafts with Medusa heads (see :class:`train.drafters.medusa.MedusaHeads`).

    Args:
        heads: the heads module; it provides ``num_heads``, ``head_logits(x [N, H], lm_head, n) -> [n, N, V]``
            (the first ``n`` heads) and ``rank_accuracy() -> [K, R]`` (for the default tree).
        lm_head: the target's LM head (used by heads without their own vocabulary projection).
        cfg: the drafter config (``decode``, ``chain_k``, ``tree_depth``, ``tree_top_k``,
            ``tree_total_tokens``, ``tree_paths``).
    """

    needs_hidden_states = True

    def __init__(self, heads: torch.nn.Module, lm_head: Callable[[torch.Tensor], torch.Tensor], cfg: Any) -> None:
        self.heads = heads.eval()
        self.lm_head = lm_head
        self.mode = Decode.parse(cfg.decode, "drafter.decode")
        self.num_heads = int(heads.num_heads)
        self.name = f"{getattr(cfg, 'name', 'medusa')}_{self.mode}"
        self.chain_k = min(int(cfg.chain_k), self.num_heads)
        self.paths: list[list[int]] = []
        if self.mode == "tree":
            if cfg.tree_paths:
                self.paths = [[int(r) for r in p] for p in cfg.tree_paths]
                static_tree_paths_to_parents(self.paths)  # validates: non-empty, ranks >= 0, prefix-closed
                deepest = max(len(p) for p in self.paths)
                if deepest > self.num_heads:
                    raise ValueError(f"drafter.tree_paths has depth {deepest} but there are {self.num_heads} heads")
            else:
                self.paths = default_tree_paths(
                    heads.rank_accuracy(), int(cfg.tree_total_tokens), int(cfg.tree_depth), int(cfg.tree_top_k)
                )
        self.depth = self.chain_k if self.mode == "chain" else max((len(p) for p in self.paths), default=0)
        self._h: torch.Tensor | None = None
        self._n = 0

    def begin(self, prompt_ids: torch.Tensor, target_out: TargetOutput) -> None:
        assert target_out.hidden_states is not None, "decoder must deliver hidden states"
        rows = target_out.hidden_states["last"]
        self._h, self._n = rows[-1], rows.shape[0]

    def commit(
        self, context: torch.Tensor, n_new: int, hidden_states_of_accepted: dict[int | str, torch.Tensor] | None
    ) -> None:
        assert hidden_states_of_accepted is not None
        rows = hidden_states_of_accepted["last"]
        self._h, self._n = rows[-1], self._n + rows.shape[0]

    @torch.inference_mode()
    def propose(self, context: torch.Tensor) -> DraftTree:
        if self._h is None:
            raise RuntimeError("propose() before begin()")
        if self._n != context.numel() - 1:
            raise RuntimeError(f"proposer has {self._n} hidden rows for a context of {context.numel()} tokens")
        if self.depth == 0:
            return empty_tree()
        logits = self.heads.head_logits(self._h[None], self.lm_head, self.depth)[:, 0].float()  # [depth, V]
        if self.mode == "chain":
            qs: list[torch.Tensor] = []
            toks = [self.draft_token(logits[k], qs) for k in range(self.depth)]
            return chain(toks, probs=torch.stack(qs) if qs else None)
        logprobs = torch.log_softmax(logits, dim=-1)

        def expand_fn(tokens: torch.Tensor, parents: list[int], expand: list[int]) -> torch.Tensor:
            # every expanded node sits at the same depth d - 1; its children come from head d
            d = tree_depths(parents)[expand[0]] + 1
            return logprobs[d - 1].expand(len(expand), -1)

        return static_tree(self.paths, expand_fn, logprobs[0])
