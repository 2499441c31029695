"""Draft trees: data structure, attention masks / positions, static and dynamic construction.

A draft tree hangs below the *root*, which is the last committed token (it is not part of the
draft).  Nodes are indexed ``0 .. N-1`` in topological order (a parent always precedes its
children); ``parents[i] == -1`` means node ``i`` is a child of the root.  A chain is the special
case ``parents == [-1, 0, 1, ..., N-2]``.

References
----------
* Miao et al., "SpecInfer", ASPLOS 2024 (arXiv:2305.09781) -- token-tree verification with a
  topology-aware causal mask.
* Cai et al., "Medusa", ICML 2024 (arXiv:2401.10774) -- static trees given as top-k index paths.
* Li et al., "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees",
  EMNLP 2024 (arXiv:2406.16858) -- dynamic tree expansion / reranking by cumulative log-prob.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import torch

TREE_ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
"""Target attention implementations that honour a custom 4-D tree mask (flash kernels do not)."""

logger = logging.getLogger(__name__)

__all__ = [
    "DraftTree",
    "ExpandFn",
    "chain",
    "dynamic_tree",
    "dynamic_tree_steps",
    "empty_tree",
    "rank_rows",
    "static_tree",
    "static_tree_paths_to_parents",
    "tree_attention_mask",
    "tree_depths",
    "tree_position_ids",
]

ExpandFn = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]
"""``expand_fn(tokens, parents, expand) -> logprobs``, the hook through which a proposer with its own
forward pass (a draft model, an EAGLE / Medusa head, ...) grows a tree.

* ``tokens``: ``LongTensor[n]`` -- all nodes created so far (topological order).
* ``parents``: ``list[int]`` of length ``n`` (``-1`` = root).
* ``expand``: indices of the nodes whose next-token log-probabilities are needed now.  Every node is
  passed at most once over the whole construction, and a node is only passed after all its
  ancestors were (so a proposer can run exactly these nodes through its model, attending to the
  committed context plus the already-run ancestors via :func:`tree_attention_mask`).
* returns ``[len(expand), V]`` log-probabilities (``<= 0``), row ``r`` for node ``expand[r]``.
"""


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node; children of the root have depth 1."""
    depths: list[int] = []
    for i, par in enumerate(parents):
        if not -1 <= par < i:
            raise ValueError(f"parents[{i}] = {par}: parents must precede children (and be >= -1)")
        depths.append(1 if par == -1 else depths[par] + 1)
    return depths


@dataclass
class DraftTree:
    """A draft: ``N`` nodes below the root (= last committed token).

    Attributes:
        tokens: ``LongTensor[N]`` token id of every node.
        parents: length-``N`` list; ``parents[i]`` is the index of node ``i``'s parent within the
            draft, ``-1`` for the root; parents precede children.
        draft_probs: optional ``[N, V]``; ``draft_probs[i]`` is the distribution ``q`` node ``i``'s
            token was SAMPLED from (speculative sampling of chains).  ``None`` means deterministic
            nodes (greedy / top-k), verified with delta proposals.  See ``eval.sampling.verify_tree``.
        scores: optional ``[N]`` cumulative draft log-probabilities (informational; set by
            :func:`dynamic_tree` / :func:`static_tree`).
    """

    tokens: torch.Tensor
    parents: list[int]
    draft_probs: torch.Tensor | None = None
    scores: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long).reshape(-1)
        self.parents = [int(p) for p in self.parents]
        if self.tokens.numel() != len(self.parents):
            raise ValueError(f"{self.tokens.numel()} tokens but {len(self.parents)} parents")
        tree_depths(self.parents)  # validates topological order
        if self.draft_probs is not None and self.draft_probs.shape[0] != len(self.parents):
            raise ValueError("draft_probs must have one row per node")

    def __len__(self) -> int:
        return len(self.parents)

    def depths(self) -> list[int]:
        """Depth of every node (children of the root have depth 1)."""
        return tree_depths(self.parents)

    def max_depth(self) -> int:
        """Depth of the deepest node (0 for an empty tree)."""
        return max(self.depths(), default=0)

    def is_chain(self) -> bool:
        """True iff ``parents == [-1, 0, 1, ..., N-2]`` (an empty draft is a chain)."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def children(self) -> list[list[int]]:
        """``children()[j + 1]`` = child indices of node ``j``; ``children()[0]`` = root children."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, par in enumerate(self.parents):
            kids[par + 1].append(i)
        return kids

    def path_to(self, node: int) -> list[int]:
        """Node indices from the first level down to ``node`` (inclusive)."""
        path: list[int] = []
        while node != -1:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def paths(self) -> list[list[int]]:
        """All root-to-leaf paths as lists of node indices (leaves in index order)."""
        kids = self.children()
        return [self.path_to(i) for i in range(len(self)) if not kids[i + 1]]

    def subtree(self, keep: Sequence[int]) -> DraftTree:
        """The tree restricted to the nodes ``keep`` (must be closed under ancestors)."""
        keep_sorted = sorted(set(int(k) for k in keep))
        remap = {old: new for new, old in enumerate(keep_sorted)}
        parents: list[int] = []
        for old in keep_sorted:
            par = self.parents[old]
            if par != -1 and par not in remap:
                raise ValueError(f"node {old} kept without its parent {par}")
            parents.append(-1 if par == -1 else remap[par])
        idx = torch.tensor(keep_sorted, dtype=torch.long)
        return DraftTree(
            tokens=self.tokens[idx],
            parents=parents,
            draft_probs=None if self.draft_probs is None else self.draft_probs[idx.to(self.draft_probs.device)],
            scores=None if self.scores is None else self.scores[idx.to(self.scores.device)],
        )

    def truncate_depth(self, max_depth: int) -> DraftTree:
        """Drop every node deeper than ``max_depth`` (a no-op copy if none is)."""
        depths = self.depths()
        if all(d <= max_depth for d in depths):
            return self
        return self.subtree([i for i, d in enumerate(depths) if d <= max_depth])


def empty_tree() -> DraftTree:
    """A draft with no nodes (the verification step then degenerates to plain decoding)."""
    return DraftTree(tokens=torch.zeros(0, dtype=torch.long), parents=[])


def chain(tokens: torch.Tensor | Sequence[int], probs: torch.Tensor | None = None) -> DraftTree:
    """A chain draft ``tokens[K]`` (``parents = [-1, 0, ..., K-2]``), optionally with ``probs[K, V]``."""
    toks = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    return DraftTree(tokens=toks, parents=list(range(-1, toks.numel() - 1)), draft_probs=probs)


def tree_attention_mask(parents: Sequence[int]) -> torch.Tensor:
    """Tree attention among draft nodes: ``mask[i, j]`` iff ``j == i`` or ``j`` is an ancestor of ``i``.

    (SpecInfer's topology-aware causal mask.)  The full verification mask is this block for the
    draft-to-draft part, plus "everything" towards the committed past and the root.

    Returns:
        ``BoolTensor[N, N]``.
    """
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    tree_depths(parents)
    for i, par in enumerate(parents):
        if par != -1:
            mask[i] = mask[par]
        mask[i, i] = True
    return mask


def tree_position_ids(parents: Sequence[int], past_len: int) -> torch.Tensor:
    """Rotary/absolute positions of the draft nodes: ``past_len + depth``.

    ``past_len`` is the position of the root (= the number of tokens before the root), so a node
    at depth ``d`` sits exactly where it would sit in a linear sequence along its path.

    Returns:
        ``LongTensor[N]``.
    """
    return torch.tensor(tree_depths(parents), dtype=torch.long) + int(past_len)


def static_tree_paths_to_parents(
    paths: Sequence[Sequence[int]],
) -> tuple[list[tuple[int, ...]], list[int]]:
    """Convert Medusa-style top-k index paths into a topologically sorted parent list.

    Each path such as ``(0, 1)`` denotes a node: "the top-1 child (0-based rank 1) of the top-0
    child of the root".  Paths are sorted by ``(depth, path)`` so parents precede children and
    siblings are ordered by rank; node ``i``'s token is the ``paths[i][-1]``-th most likely token
    given its parent.  Every prefix of a path must itself be a path.

    Example: ``[(0,), (1,), (0, 0), (0, 1), (1, 0)]`` -> parents ``[-1, -1, 0, 0, 1]``.

    Returns:
        ``(sorted_paths, parents)``.
    """
    sorted_paths = sorted({tuple(int(x) for x in p) for p in paths}, key=lambda p: (len(p), p))
    if any(len(p) == 0 for p in sorted_paths):
        raise ValueError("empty path")
    if any(x < 0 for p in sorted_paths for x in p):
        raise ValueError("path entries are top-k ranks and must be >= 0")
    index = {p: i for i, p in enumerate(sorted_paths)}
    parents: list[int] = []
    for p in sorted_paths:
        if len(p) == 1:
            parents.append(-1)
        elif p[:-1] in index:
            parents.append(index[p[:-1]])
        else:
            raise ValueError(f"path {p} has no parent path {p[:-1]}")
    return sorted_paths, parents


def _stable_topk(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of a 1-D tensor with ties broken by the lower index (deterministic).

    Exact and O(V): the k-th largest value is found with ``topk``; only the (usually k) entries at or above
    it are then sorted stably, instead of sorting the whole vocabulary.
    """
    if k <= 0 or values.numel() == 0:
        return values[:0], torch.zeros(0, dtype=torch.long)
    if k >= values.numel():
        vals, idx = values.sort(descending=True, stable=True)
        return vals[:k], idx[:k]
    kth = values.topk(k).values[-1]
    cand = torch.nonzero(values >= kth).flatten()  # ascending indices
    vals, order = values[cand].sort(descending=True, stable=True)
    return vals[:k], cand[order[:k]]


def _stable_topk_rows(
    values: torch.Tensor, k: int, clamp_at_zero: bool = False
) -> tuple[list[list[float]], list[list[int]]]:
    """:func:`_stable_topk` of every row of a 2-D tensor (same result), with one ``topk`` for all rows; with
    ``clamp_at_zero``, of the rows ``clamp_max(0)``-ed (without clamping the whole tensor).

    A row's top k are exact when its (k+1)-th largest value is below its k-th (no tie across the cut; float
    log-probs rarely tie): they are then ordered by value, then index. Other rows, and with ``clamp_at_zero`` rows
    holding a positive value (which the clamp would tie with others at 0), take the one-row path.
    """
    n, V = values.shape
    k = min(k, V)
    if k <= 0:
        return [[] for _ in range(n)], [[] for _ in range(n)]
    kk = min(k + 1, V)
    top_v, top_i = values.topk(kk, dim=-1)
    exact = top_v[:, k] < top_v[:, k - 1] if kk > k else torch.ones(n, dtype=torch.bool)
    if clamp_at_zero:
        exact &= top_v[:, 0] <= 0
    out_v: list[list[float]] = []
    out_i: list[list[int]] = []
    for r, (tv, ti, ok) in enumerate(zip(top_v[:, :k].tolist(), top_i[:, :k].tolist(), exact.tolist(), strict=True)):
        if ok:
            pairs = sorted(zip(tv, ti, strict=True), key=lambda p: (-p[0], p[1]))
            out_v.append([v for v, _ in pairs])
            out_i.append([i for _, i in pairs])
        else:
            v, i = _stable_topk(values[r].clamp_max(0.0) if clamp_at_zero else values[r], k)
            out_v.append(v.tolist())
            out_i.append(i.tolist())
    return out_v, out_i


def static_tree(paths: Sequence[Sequence[int]], expand_fn: ExpandFn, root_logprobs: torch.Tensor) -> DraftTree:
    """Fill a static (Medusa-style) tree with tokens, level by level.

    Node ``(k_1, ..., k_d)`` gets the ``k_d``-th most likely token of its parent's next-token
    distribution (``root_logprobs`` for depth 1, ``expand_fn`` below).  Only parents that have
    children are expanded.  A Medusa head can implement ``expand_fn`` by returning head ``d``'s
    distribution for every node at depth ``d - 1``.

    Args:
        paths: top-k index paths, see :func:`static_tree_paths_to_parents`.
        expand_fn: see :data:`ExpandFn`.
        root_logprobs: ``[V]`` next-token log-probs after the root.

    Returns:
        A deterministic :class:`DraftTree` (``draft_probs=None``) with cumulative ``scores``.
    """
    sorted_paths, parents = static_tree_paths_to_parents(paths)
    n = len(sorted_paths)
    depths = [len(p) for p in sorted_paths]
    tokens = torch.zeros(n, dtype=torch.long)
    scores = torch.zeros(n, dtype=torch.float32)
    root_lp = root_logprobs.detach().float().cpu().reshape(-1).clamp_max(0.0)
    max_depth = max(depths, default=0)
    for d in range(1, max_depth + 1):
        level = [i for i in range(n) if depths[i] == d]
        if d == 1:
            rows = {-1: root_lp}
        else:
            to_expand = sorted({parents[i] for i in level})
            lps = expand_fn(tokens[: level[0]].clone(), parents[: level[0]], to_expand)
            lps = lps.detach().float().cpu().clamp_max(0.0)
            rows = {node: lps[r] for r, node in enumerate(to_expand)}
        ranked = {par: _stable_topk(row, row.numel()) for par, row in rows.items()}
        for i in level:
            vals, idx = ranked[parents[i]]
            rank = sorted_paths[i][-1]
            if rank >= idx.numel():
                raise ValueError(f"path {sorted_paths[i]} asks for rank {rank} of a {idx.numel()}-token vocab")
            tokens[i] = idx[rank]
            scores[i] = vals[rank] + (scores[parents[i]] if parents[i] != -1 else 0.0)
    return DraftTree(tokens=tokens, parents=parents, scores=scores)


def dynamic_tree(
    expand_fn: ExpandFn,
    root_logprobs: torch.Tensor,
    depth: int,
    top_k: int,
    total_tokens: int,
) -> DraftTree:
    """EAGLE-2 style dynamic draft tree (Li et al., 2024, Sec. 4).

    Expansion: depth 1 = the ``top_k`` most likely tokens after the root.  For every further depth
    the ``top_k`` nodes of the previous depth with the highest cumulative log-prob (the "frontier")
    are expanded through ``expand_fn`` and each contributes its ``top_k`` most likely children
    (score = parent score + log-prob), so up to ``top_k**2`` candidates join per depth.

    Reranking: all candidates are ranked by cumulative log-prob (ties: earlier-created node first)
    and the best ``total_tokens`` are kept.  Because a child's score never exceeds its parent's,
    the top-``total_tokens`` set is closed under ancestors (with the stable tie-break a parent
    always ranks before its child); the selection loop additionally only admits a node whose parent
    was admitted, which makes that guarantee hold even with rounding.

    Args:
        expand_fn: see :data:`ExpandFn` (called ``depth - 1`` times at most).
        root_logprobs: ``[V]`` next-token log-probs after the root.
        depth: maximum tree depth (>= 1).
        top_k: branching factor / frontier size.
        total_tokens: number of draft nodes kept.

    Returns:
        A deterministic :class:`DraftTree` (``draft_probs=None``) with cumulative ``scores``.
    """
    steps = dynamic_tree_steps(root_logprobs, depth, top_k, total_tokens)
    try:
        request = next(steps)
        while True:
            request = steps.send(expand_fn(*request))
    except StopIteration as done:
        return done.value


TreeRequest = tuple[torch.Tensor, list[int], list[int]]
"""What :func:`dynamic_tree_steps` yields: ``expand_fn``'s arguments ``(tokens, parents, expand)``."""


Ranked = tuple[list[list[float]], list[list[int]]]
"""Per row, the ``k`` largest log-probs and their token ids, largest first, ties by lower id (:func:`rank_rows`)."""


def rank_rows(logprobs: torch.Tensor, k: int) -> Ranked:
    """The ranking :func:`dynamic_tree_steps` makes of log-prob rows ``[n, V]`` (clamped at 0), for many rows at
    once: a caller growing many trees side by side ranks all their rows in one call and sends each tree its share."""
    return _stable_topk_rows(logprobs.detach().float().cpu().reshape(-1, logprobs.shape[-1]), k, clamp_at_zero=True)


def dynamic_tree_steps(
    root_logprobs: torch.Tensor | Ranked, depth: int, top_k: int, total_tokens: int
) -> Generator[TreeRequest, torch.Tensor | Ranked, DraftTree]:
    """:func:`dynamic_tree` as a generator, so that many trees can be grown side by side with one batched model
    call per depth (vectorised replay, :mod:`eval.replay`): it yields ``expand_fn``'s arguments, is sent the
    log-probs ``expand_fn`` would return (or their :func:`rank_rows` with ``k = top_k``), and returns the tree
    (``StopIteration.value``). The root's log-probs may also come ranked (one row). Same tree as
    :func:`dynamic_tree` for the same log-probs."""
    if depth < 1 or top_k < 1 or total_tokens < 0:
        raise ValueError(f"bad dynamic tree config depth={depth} top_k={top_k} total_tokens={total_tokens}")
    if isinstance(root_logprobs, torch.Tensor):
        root_vals, root_idx = rank_rows(root_logprobs.reshape(1, -1), top_k)
    else:
        root_vals, root_idx = root_logprobs
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []

    frontier: list[int] = []
    for v, t in zip(root_vals[0], root_idx[0], strict=True):
        if v == float("-inf"):
            continue
        frontier.append(len(tokens))
        tokens.append(int(t))
        parents.append(-1)
        scores.append(float(v))

    for _ in range(2, depth + 1):
        if not frontier:
            break
        got = yield torch.tensor(tokens, dtype=torch.long), list(parents), list(frontier)
        row_vals, row_idx = rank_rows(got, top_k) if isinstance(got, torch.Tensor) else got
        if len(row_vals) != len(frontier):
            raise ValueError(f"expand_fn returned {len(row_vals)} rows for {len(frontier)} nodes")
        new_nodes: list[int] = []
        for node, vals_r, idx_r in zip(frontier, row_vals, row_idx, strict=True):
            for v, t in zip(vals_r, idx_r, strict=True):
                if v == float("-inf"):
                    continue
                new_nodes.append(len(tokens))
                tokens.append(int(t))
                parents.append(node)
                scores.append(scores[node] + float(v))
        # the top_k new nodes by score, ties by creation order (a stable sort; plain Python on these few floats)
        best = sorted(range(len(new_nodes)), key=lambda j: (-scores[new_nodes[j]], j))[:top_k]
        frontier = sorted(new_nodes[j] for j in best)

    # rerank: stable sort by score, admit a node only after its parent
    order = torch.tensor(scores, dtype=torch.float64).sort(descending=True, stable=True).indices.tolist()
    kept: set[int] = set()
    for i in order:
        if len(kept) >= total_tokens:
            break
        if parents[i] == -1 or parents[i] in kept:
            kept.add(i)
    full = DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.long),
        parents=parents,
        scores=torch.tensor(scores, dtype=torch.float32),
    )
    return full.subtree(sorted(kept))
