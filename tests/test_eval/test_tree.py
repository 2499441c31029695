"""Tests of eval.tree: structure helpers, masks, positions, static and dynamic construction."""

from __future__ import annotations

import math

import pytest
import torch

from eval.tree import (
    DraftTree,
    chain,
    dynamic_tree,
    empty_tree,
    static_tree,
    static_tree_paths_to_parents,
    tree_attention_mask,
    tree_position_ids,
)

#        root
#      /  |   \
#    n0   n1   n2
#    |    |  \
#    n3   n4  n5
#         |
#         n6
PARENTS = [-1, -1, -1, 0, 1, 1, 4]


def test_tree_attention_mask_hand_made() -> None:
    expected = torch.tensor(
        [
            # n0 n1 n2 n3 n4 n5 n6
            [1, 0, 0, 0, 0, 0, 0],  # n0
            [0, 1, 0, 0, 0, 0, 0],  # n1
            [0, 0, 1, 0, 0, 0, 0],  # n2
            [1, 0, 0, 1, 0, 0, 0],  # n3 -> n0
            [0, 1, 0, 0, 1, 0, 0],  # n4 -> n1
            [0, 1, 0, 0, 0, 1, 0],  # n5 -> n1
            [0, 1, 0, 0, 1, 0, 1],  # n6 -> n4 -> n1
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree_attention_mask(PARENTS), expected)


def test_tree_attention_mask_of_chain_is_causal() -> None:
    assert torch.equal(tree_attention_mask([-1, 0, 1, 2]), torch.ones(4, 4, dtype=torch.bool).tril())


def test_tree_position_ids_hand_made() -> None:
    assert tree_position_ids(PARENTS, past_len=10).tolist() == [11, 11, 11, 12, 12, 12, 13]
    assert tree_position_ids([], past_len=3).tolist() == []


def test_draft_tree_helpers() -> None:
    tree = DraftTree(tokens=torch.tensor([10, 11, 12, 13, 14, 15, 16]), parents=PARENTS)
    assert tree.depths() == [1, 1, 1, 2, 2, 2, 3]
    assert tree.max_depth() == 3
    assert not tree.is_chain()
    assert sorted(tree.paths()) == [[0, 3], [1, 4, 6], [1, 5], [2]]
    assert tree.path_to(6) == [1, 4, 6]
    assert tree.children()[0] == [0, 1, 2] and tree.children()[2] == [4, 5]
    cut = tree.truncate_depth(2)
    assert cut.parents == [-1, -1, -1, 0, 1, 1] and cut.tokens.tolist() == [10, 11, 12, 13, 14, 15]
    sub = tree.subtree([1, 4, 6])
    assert sub.parents == [-1, 0, 1] and sub.tokens.tolist() == [11, 14, 16] and sub.is_chain()
    with pytest.raises(ValueError):
        tree.subtree([4])  # parent missing
    assert chain([3, 4, 5]).is_chain() and chain([3, 4, 5]).parents == [-1, 0, 1]
    assert len(empty_tree()) == 0 and empty_tree().is_chain()


def test_draft_tree_validation() -> None:
    with pytest.raises(ValueError):
        DraftTree(tokens=torch.tensor([1, 2]), parents=[-1, 1])  # a node cannot be its own parent
    with pytest.raises(ValueError):
        DraftTree(tokens=torch.tensor([1, 2]), parents=[1, -1])  # parent after child
    with pytest.raises(ValueError):
        DraftTree(tokens=torch.tensor([1]), parents=[-1, 0])


def test_static_tree_paths_to_parents() -> None:
    paths, parents = static_tree_paths_to_parents([(0, 1), (1,), (0,), (1, 0), (0, 0)])
    assert paths == [(0,), (1,), (0, 0), (0, 1), (1, 0)]
    assert parents == [-1, -1, 0, 0, 1]
    paths, parents = static_tree_paths_to_parents([(0,), (0, 0), (0, 0, 0), (1,), (0, 1), (0, 0, 1)])
    assert paths == [(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 1)]
    assert parents == [-1, -1, 0, 0, 2, 2]
    with pytest.raises(ValueError):
        static_tree_paths_to_parents([(0,), (1, 0)])  # (1,) missing


# A hand-made next-token model over V = 6 tokens: the distribution after a node depends on the
# node's token only.  Zero-probability tokens have log-prob -inf and must never become nodes.
V = 6
ROOT = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0, 0.0])
NEXT = {
    0: torch.tensor([0.0, 0.0, 0.0, 0.64, 0.36, 0.0]),
    1: torch.tensor([0.0, 0.0, 0.0, 0.9, 0.0, 0.1]),
    2: torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0]),
    3: torch.tensor([0.7, 0.3, 0.0, 0.0, 0.0, 0.0]),
    4: torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 0.0]),
    5: torch.tensor([0.2, 0.2, 0.2, 0.2, 0.1, 0.1]),
}


class RecordingExpand:
    """expand_fn that records its calls and checks the ExpandFn contract."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.seen: set[int] = set()

    def __call__(self, tokens: torch.Tensor, parents: list[int], expand: list[int]) -> torch.Tensor:
        assert tokens.numel() == len(parents)
        for i in expand:
            assert i not in self.seen, "a node is expanded twice"
            assert parents[i] == -1 or parents[i] in self.seen, "a node is expanded before its parent"
        self.seen.update(expand)
        self.calls.append(list(expand))
        return torch.stack([NEXT[int(tokens[i])].log() for i in expand])


def test_dynamic_tree_selection_hand_made() -> None:
    # depth 1: A=tok0 (.5), B=tok1 (.3)                       [C ignored: top_k=2]
    # depth 2: expand A,B -> C=A.3 (.32), D=A.4 (.18), E=B.3 (.27), F=B.5 (.03); frontier C, E
    # depth 3: expand C,E -> G=C.0 (.224), H=C.1 (.096), I=E.0 (.189), J=E.1 (.081)
    # ranking: A .5, C .32, B .3, E .27, G .224, I .189, D .18, H .096, J .081, F .03
    expand = RecordingExpand()
    tree = dynamic_tree(expand, ROOT.log(), depth=3, top_k=2, total_tokens=4)
    assert expand.calls == [[0, 1], [2, 4]]
    # kept in creation order: A, B, C, E
    assert tree.tokens.tolist() == [0, 1, 3, 3]
    assert tree.parents == [-1, -1, 0, 1]
    torch.testing.assert_close(tree.scores.exp(), torch.tensor([0.5, 0.3, 0.32, 0.27]))

    tree = dynamic_tree(RecordingExpand(), ROOT.log(), depth=3, top_k=2, total_tokens=7)
    # + G (.224, child of C), I (.189, child of E), D (.18, child of A): A B C D E G I
    assert tree.tokens.tolist() == [0, 1, 3, 4, 3, 0, 0]
    assert tree.parents == [-1, -1, 0, 0, 1, 2, 4]
    assert all(s <= tree.scores[p] for s, p in zip(tree.scores, tree.parents, strict=True) if p != -1)


def test_dynamic_tree_skips_zero_probability_tokens_and_respects_budget() -> None:
    tree = dynamic_tree(RecordingExpand(), ROOT.log(), depth=4, top_k=4, total_tokens=100)
    assert torch.isfinite(tree.scores).all()
    # only tokens 0, 1, 2 have mass at the root
    assert sorted(tree.tokens[[i for i, p in enumerate(tree.parents) if p == -1]].tolist()) == [0, 1, 2]
    tree = dynamic_tree(RecordingExpand(), ROOT.log(), depth=4, top_k=4, total_tokens=5)
    assert len(tree) == 5
    # depth 1 only: no expand calls
    expand = RecordingExpand()
    tree = dynamic_tree(expand, ROOT.log(), depth=1, top_k=2, total_tokens=10)
    assert expand.calls == [] and tree.tokens.tolist() == [0, 1] and tree.is_chain() is False


def test_dynamic_tree_ties_are_stable_and_closed_under_ancestors() -> None:
    # uniform distributions everywhere -> many exact ties; parent always precedes child in ranking
    def expand(tokens: torch.Tensor, parents: list[int], ids: list[int]) -> torch.Tensor:
        return torch.full((len(ids), 4), math.log(0.25))

    tree = dynamic_tree(expand, torch.full((4,), math.log(0.25)), depth=3, top_k=2, total_tokens=5)
    assert tree.tokens.tolist() == [0, 1, 0, 1, 0]
    assert tree.parents == [-1, -1, 0, 0, 1]


def test_static_tree_fills_tokens_by_rank() -> None:
    expand = RecordingExpand()
    tree = static_tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)], expand, ROOT.log())
    assert tree.parents == [-1, -1, 0, 0, 1, 2]
    # (0,)=tok0, (1,)=tok1, (0,0)=top0 after tok0=3, (0,1)=4, (1,0)=top0 after tok1=3, (0,0,0)=top0 after 3=0
    assert tree.tokens.tolist() == [0, 1, 3, 4, 3, 0]
    assert expand.calls == [[0, 1], [2]]
    torch.testing.assert_close(tree.scores.exp(), torch.tensor([0.5, 0.3, 0.32, 0.18, 0.27, 0.224]))


def test_row_topk_equals_the_one_row_stable_topk_with_ties() -> None:
    """dynamic_tree's batched top-k (one topk for all expanded nodes) gives exactly the one-row result, ties
    included (lower index first), also at the k-th boundary and with -inf entries."""
    from eval.tree import _stable_topk, _stable_topk_rows

    g = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 50, generator=g).round(decimals=1)  # many exact ties
    rows[1, :] = 0.5  # all tied
    rows[2, 10:] = float("-inf")  # fewer finite entries than some k
    rows[3, [3, 7, 9]] = 9.0  # a tie inside the top k
    for k in (1, 3, 4, 12, 50):
        vals, idx = _stable_topk_rows(rows, k)
        for r in range(rows.shape[0]):
            v1, i1 = _stable_topk(rows[r], k)
            assert idx[r] == i1.tolist() and vals[r] == v1.tolist(), (k, r)
        # clamped at 0 without clamping the tensor (rank_rows): positive entries tie at 0, as after clamp_max
        vals, idx = _stable_topk_rows(rows, k, clamp_at_zero=True)
        for r in range(rows.shape[0]):
            v1, i1 = _stable_topk(rows[r].clamp_max(0.0), k)
            assert idx[r] == i1.tolist() and vals[r] == v1.tolist(), (k, r, "clamped")
