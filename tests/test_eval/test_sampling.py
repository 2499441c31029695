"""Exact and statistical tests of eval.sampling (verification maths)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from eval import sampling
from eval.sampling import (
    greedy_verify_chain,
    logits_to_probs,
    residual_distribution,
    sample_from_probs,
    speculative_verify_chain,
    verify_tree,
)
from eval.tree import DraftTree, chain

Chi2 = Callable[[torch.Tensor, torch.Tensor], tuple[float, float]]
Verifier = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator], tuple[int, int]]

V = 5
P0 = torch.tensor([0.05, 0.40, 0.30, 0.20, 0.05])
Q0 = torch.tensor([0.30, 0.10, 0.10, 0.20, 0.30])
P1 = torch.tensor([0.10, 0.10, 0.50, 0.20, 0.10])
N_SAMPLES = 4_000
N_WRONG = 2_000  # wrong formulas are off by orders of magnitude (chi2 ~ 10^2..10^4 vs ~19)


def onehot(i: int, v: int = V) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(i), v).float()


# ---------------------------------------------------------------------------------------------
# logits_to_probs
# ---------------------------------------------------------------------------------------------


def test_logits_to_probs_temperature_zero_is_onehot_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 0.0, 0.0]])
    probs = logits_to_probs(logits, temperature=0.0, top_p=0.5)
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_logits_to_probs_temperature_scales_softmax() -> None:
    logits = torch.tensor([1.0, 2.0, 4.0])
    for t in (0.5, 1.0, 2.0):
        torch.testing.assert_close(logits_to_probs(logits, t), torch.softmax(logits / t, -1))


def test_logits_to_probs_top_p_keeps_smallest_nucleus() -> None:
    probs = torch.tensor([0.1, 0.5, 0.15, 0.25])
    logits = probs.log()
    # sorted: 0.5, 0.25, 0.15, 0.1 -> cumulative 0.5, 0.75, 0.9, 1.0
    torch.testing.assert_close(logits_to_probs(logits, 1.0, top_p=0.5), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(logits_to_probs(logits, 1.0, top_p=0.6), torch.tensor([0.0, 2 / 3, 0.0, 1 / 3]))
    torch.testing.assert_close(logits_to_probs(logits, 1.0, top_p=0.75), torch.tensor([0.0, 2 / 3, 0.0, 1 / 3]))
    torch.testing.assert_close(
        logits_to_probs(logits, 1.0, top_p=0.8), torch.tensor([0.0, 0.5, 0.15, 0.25]) / 0.9, atol=1e-6, rtol=0
    )
    torch.testing.assert_close(logits_to_probs(logits, 1.0, top_p=1.0), probs)
    # batched rows are filtered independently
    batch = torch.stack([logits, logits.flip(0)])
    out = logits_to_probs(batch, 1.0, top_p=0.5)
    assert torch.equal(out, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]))


def test_logits_to_probs_rejects_bad_args() -> None:
    with pytest.raises(ValueError):
        logits_to_probs(torch.zeros(3), -1.0)
    with pytest.raises(ValueError):
        logits_to_probs(torch.zeros(3), 1.0, top_p=0.0)


def test_sample_from_probs_never_picks_zero_mass_and_is_deterministic() -> None:
    p = torch.tensor([0.0, 0.3, 0.0, 0.7, 0.0])
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = [sample_from_probs(p, g1) for _ in range(500)]
    b = [sample_from_probs(p, g2) for _ in range(500)]
    assert a == b
    assert set(a) == {1, 3}
    with pytest.raises(ValueError):
        sample_from_probs(torch.zeros(3), g1)


# ---------------------------------------------------------------------------------------------
# greedy verification
# ---------------------------------------------------------------------------------------------


def _logits_with_argmax(argmaxes: list[int], v: int = 8) -> torch.Tensor:
    logits = torch.randn(len(argmaxes), v, generator=torch.Generator().manual_seed(0))
    for r, a in enumerate(argmaxes):
        logits[r, a] = 10.0
    return logits


@pytest.mark.parametrize(
    ("drafts", "argmaxes", "expected"),
    [
        ([3, 4, 5], [3, 4, 5, 6], (3, 6)),  # all accepted -> bonus token
        ([3, 4, 5], [3, 1, 5, 6], (1, 1)),  # mismatch at position 1 -> target's token there
        ([3, 4, 5], [0, 4, 5, 6], (0, 0)),
        ([3, 4, 5], [3, 4, 7, 6], (2, 7)),
        ([], [2], (0, 2)),  # empty draft = plain decoding
    ],
)
def test_greedy_verify_chain(drafts: list[int], argmaxes: list[int], expected: tuple[int, int]) -> None:
    assert greedy_verify_chain(torch.tensor(drafts, dtype=torch.long), _logits_with_argmax(argmaxes)) == expected


def test_greedy_verify_chain_shape_check() -> None:
    with pytest.raises(ValueError):
        greedy_verify_chain(torch.tensor([1, 2]), torch.zeros(2, 4))


# ---------------------------------------------------------------------------------------------
# residual / speculative chain verification (exact cases)
# ---------------------------------------------------------------------------------------------


def test_residual_distribution_exact() -> None:
    p = torch.tensor([0.5, 0.2, 0.3, 0.0])
    q = torch.tensor([0.1, 0.6, 0.1, 0.2])
    # max(0, p - q) = [0.4, 0, 0.2, 0] -> normalised
    torch.testing.assert_close(residual_distribution(p, q), torch.tensor([2 / 3, 0.0, 1 / 3, 0.0]))
    # zero mass (p == q) falls back to p
    torch.testing.assert_close(residual_distribution(p, p), p)


def test_speculative_chain_p_equals_q_always_accepts() -> None:
    g = torch.Generator().manual_seed(0)
    probs = torch.stack([P0, P1, Q0])
    for _ in range(200):
        drafts = torch.tensor([sample_from_probs(probs[i], g) for i in range(3)])
        target = torch.cat([probs, P1[None]])
        n_acc, nxt = speculative_verify_chain(drafts, probs, target, g)
        assert n_acc == 3
        assert 0 <= nxt < V


def test_speculative_chain_rejects_where_p_is_zero_and_residual_is_exact() -> None:
    # q puts all its mass on token 0, where p is 0 -> always rejected at position 0,
    # and the replacement is drawn from norm(max(0, p - q)) = p (q's support is disjoint from p's).
    p = torch.tensor([0.0, 0.5, 0.25, 0.25, 0.0])
    q = onehot(0)
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(V)
    for _ in range(4000):
        n_acc, nxt = speculative_verify_chain(torch.tensor([0, 1]), torch.stack([q, q]), torch.stack([p, p, p]), g)
        assert n_acc == 0
        counts[nxt] += 1
    assert counts[0] == 0 and counts[4] == 0
    freq = counts / counts.sum()
    assert abs(freq[1] - 0.5) < 0.04 and abs(freq[2] - 0.25) < 0.04


def test_speculative_chain_rejection_position_and_residual_support() -> None:
    # position 0 is certain to be accepted (p = q = onehot), position 1 certain to be rejected
    p_rows = torch.stack([onehot(2), torch.tensor([0.0, 0.0, 0.0, 0.6, 0.4]), P1])
    q_rows = torch.stack([onehot(2), onehot(1)])
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        n_acc, nxt = speculative_verify_chain(torch.tensor([2, 1]), q_rows, p_rows, g)
        assert n_acc == 1
        assert nxt in (3, 4)


# ---------------------------------------------------------------------------------------------
# statistical losslessness (pure maths, many samples, fixed seeds)
# ---------------------------------------------------------------------------------------------


def _first_token_counts(verify: Callable[[torch.Generator], int], n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V)
    for _ in range(n):
        counts[verify(g)] += 1
    return counts


def _chain_first_token(verifier: Verifier) -> Callable[[torch.Generator], int]:
    q_rows = torch.stack([Q0, P1])

    def run(g: torch.Generator) -> int:
        drafts = torch.tensor([sample_from_probs(Q0, g), sample_from_probs(P1, g)])
        n_acc, nxt = verifier(drafts, q_rows, torch.stack([P0, P1, P0]), g)
        return int(drafts[0]) if n_acc >= 1 else nxt

    return run


def _wrong_accept_q_over_p(
    drafts: torch.Tensor, q_rows: torch.Tensor, p_rows: torch.Tensor, g: torch.Generator
) -> tuple[int, int]:
    """WRONG: accepts with min(1, q/p) instead of min(1, p/q)."""
    for i in range(len(drafts)):
        x = int(drafts[i])
        if sampling.uniform(g) * p_rows[i, x] < q_rows[i, x]:
            continue
        return i, sample_from_probs(residual_distribution(p_rows[i], q_rows[i]), g)
    return len(drafts), sample_from_probs(p_rows[-1], g)


def _wrong_resample_from_p(
    drafts: torch.Tensor, q_rows: torch.Tensor, p_rows: torch.Tensor, g: torch.Generator
) -> tuple[int, int]:
    """WRONG: resamples from p (not from the residual max(0, p - q)) after a rejection."""
    for i in range(len(drafts)):
        x = int(drafts[i])
        if sampling.uniform(g) * q_rows[i, x] < p_rows[i, x]:
            continue
        return i, sample_from_probs(p_rows[i], g)
    return len(drafts), sample_from_probs(p_rows[-1], g)


def _wrong_resample_from_abs_diff(
    drafts: torch.Tensor, q_rows: torch.Tensor, p_rows: torch.Tensor, g: torch.Generator
) -> tuple[int, int]:
    """WRONG: uses the un-clipped difference |p - q| as the residual."""
    for i in range(len(drafts)):
        x = int(drafts[i])
        if sampling.uniform(g) * q_rows[i, x] < p_rows[i, x]:
            continue
        return i, sample_from_probs((p_rows[i] - q_rows[i]).abs(), g)
    return len(drafts), sample_from_probs(p_rows[-1], g)


def test_speculative_chain_first_token_is_distributed_as_p(chi2: Chi2) -> None:
    counts = _first_token_counts(_chain_first_token(speculative_verify_chain), N_SAMPLES, seed=10)
    stat, crit = chi2(counts, P0)
    assert stat < crit, (stat, crit, counts / counts.sum())


@pytest.mark.parametrize("wrong", [_wrong_accept_q_over_p, _wrong_resample_from_p, _wrong_resample_from_abs_diff])
def test_chain_check_detects_wrong_formulas(chi2: Chi2, wrong: Verifier) -> None:
    """The same check with the same sample size rejects plausible-looking wrong formulas."""
    counts = _first_token_counts(_chain_first_token(wrong), N_WRONG, seed=10)
    stat, crit = chi2(counts, P0)
    assert stat > 3 * crit, (stat, crit)


def _tree_first_two(tree: DraftTree, target: torch.Tensor, g: torch.Generator) -> tuple[int, int | None]:
    accepted, nxt = verify_tree(tree, target, g)
    toks = tree.tokens.tolist()
    emitted = [toks[i] for i in accepted] + [nxt]
    return emitted[0], (emitted[1] if len(emitted) > 1 else None)


def test_tree_delta_children_lossless(chi2: Chi2) -> None:
    # root children: tokens 1 (node 0) and 3 (node 1); node 0 has children 2 (node 2) and 0 (node 3)
    tree = DraftTree(tokens=torch.tensor([1, 3, 2, 0]), parents=[-1, -1, 0, 0])
    p_after_node0 = P1
    target = torch.stack([P0, p_after_node0, Q0, Q0, Q0])
    g = torch.Generator().manual_seed(11)
    first = torch.zeros(V)
    second_given_1 = torch.zeros(V)
    for _ in range(N_SAMPLES):
        a, b = _tree_first_two(tree, target, g)
        first[a] += 1
        if a == 1:  # node 0 accepted -> the second token is drawn at node 0 from p_after_node0
            assert b is not None
            second_given_1[b] += 1
    stat, crit = chi2(first, P0)
    assert stat < crit, (stat, crit)
    stat, crit = chi2(second_given_1, p_after_node0)
    assert stat < crit, (stat, crit)


def test_tree_delta_check_detects_missing_renormalisation(chi2: Chi2) -> None:
    """Wrong variant: after rejecting a delta child, keep sampling from the untouched p."""
    tree = DraftTree(tokens=torch.tensor([1, 3]), parents=[-1, -1])
    g = torch.Generator().manual_seed(11)
    counts = torch.zeros(V)
    for _ in range(N_WRONG):
        chosen = None
        for c in (0, 1):
            x = int(tree.tokens[c])
            if sampling.uniform(g) < float(P0[x]):
                chosen = x
                break
        counts[chosen if chosen is not None else sample_from_probs(P0, g)] += 1
    stat, crit = chi2(counts, P0)
    assert stat > 3 * crit, (stat, crit)


def test_tree_sampled_children_lossless(chi2: Chi2) -> None:
    """SpecInfer multi-candidate: two root children sampled i.i.d. from q (draft_probs given)."""
    g = torch.Generator().manual_seed(12)
    counts = torch.zeros(V)
    target = torch.stack([P0, P1, P1])
    for _ in range(N_SAMPLES):
        toks = torch.tensor([sample_from_probs(Q0, g), sample_from_probs(Q0, g)])
        tree = DraftTree(tokens=toks, parents=[-1, -1], draft_probs=torch.stack([Q0, Q0]))
        a, _ = _tree_first_two(tree, target, g)
        counts[a] += 1
    stat, crit = chi2(counts, P0)
    assert stat < crit, (stat, crit)


def test_verify_tree_sampled_chain_matches_speculative_chain() -> None:
    """A chain with draft_probs goes through speculative_verify_chain (same random stream)."""
    q_rows = torch.stack([Q0, P1, P0])
    p_rows = torch.stack([P0, P1, Q0, P1])
    for seed in range(50):
        g = torch.Generator().manual_seed(seed)
        drafts = torch.tensor([sample_from_probs(q_rows[i], g) for i in range(3)])
        g1, g2 = torch.Generator().manual_seed(seed + 100), torch.Generator().manual_seed(seed + 100)
        n_acc, nxt = speculative_verify_chain(drafts, q_rows, p_rows, g1)
        accepted, nxt2 = verify_tree(chain(drafts, q_rows), p_rows, g2)
        assert accepted == list(range(n_acc)) and nxt2 == nxt


# ---------------------------------------------------------------------------------------------
# greedy tree verification (hand-made tree)
# ---------------------------------------------------------------------------------------------


def test_verify_tree_greedy_walks_the_matching_path() -> None:
    #        root
    #      /  |   \
    #    n0(4) n1(2) n2(7)
    #    |      |  \
    #  n3(1)  n4(5) n5(6)
    #           |
    #         n6(3)
    tree = DraftTree(tokens=torch.tensor([4, 2, 7, 1, 5, 6, 3]), parents=[-1, -1, -1, 0, 1, 1, 4])
    # target argmax per row: row 0 = root, row i+1 = after node i
    argmax = {0: 2, 2: 5, 5: 3, 7: 0}  # root->2 (n1), after n1 -> 5 (n4), after n4 -> 3 (n6), after n6 -> 0
    rows = [0] * 8
    for r, a in argmax.items():
        rows[r] = a
    logits = _logits_with_argmax(rows)
    accepted, nxt = verify_tree(tree, logits, greedy=True)
    assert accepted == [1, 4, 6]
    assert nxt == 0
    # the root prediction matches no child -> nothing accepted, next token = root argmax
    rows[0] = 3
    accepted, nxt = verify_tree(tree, _logits_with_argmax(rows), greedy=True)
    assert accepted == [] and nxt == 3
    # mismatch below n1 -> stop at n1
    rows[0], rows[2] = 2, 0
    accepted, nxt = verify_tree(tree, _logits_with_argmax(rows), greedy=True)
    assert accepted == [1] and nxt == 0


def test_verify_tree_greedy_equals_greedy_chain_on_chains() -> None:
    gen = torch.Generator().manual_seed(4)
    for _ in range(50):
        drafts = torch.randint(0, 3, (4,), generator=gen)
        logits = torch.randn(5, 3, generator=gen)
        n_acc, nxt = greedy_verify_chain(drafts, logits)
        accepted, nxt2 = verify_tree(chain(drafts), logits, greedy=True)
        assert accepted == list(range(n_acc)) and nxt2 == nxt


def test_verify_tree_shape_check() -> None:
    with pytest.raises(ValueError):
        verify_tree(chain([1, 2]), torch.zeros(2, 4), greedy=True)
