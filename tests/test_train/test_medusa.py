"""Medusa-1 heads: the loss's indexing, the default tree builder, save/load, lossless decoding on the real
target (chain and tree), and stage train (loss falls, per-head metrics logged, kill-and-resume == uninterrupted)."""

from __future__ import annotations

import itertools
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.conftest import SMALL_SYNTH, compose
from tests.derived import assert_best_is_best_check
from tests.test_train.runs import assert_greedy_identity, assert_kill_resume_exact
from tests.test_train.runs import losses as _losses
from tests.test_train.runs import ok as _ok
from tests.test_train.runs import run_train as _run

pytestmark = pytest.mark.slow

TRAIN = [
    "drafter=medusa",
    "train.features=online",
    "train.max_steps=4",
    "train.micro_batch_size=2",
    "train.grad_accum=2",
    "train.lr=3e-3",
    "train.warmup_steps=1",
    "train.save_every=2",
    "train.eval_every=0",
    "train.eval_prompts=1",
    "train.eval_max_new_tokens=8",
    "train.log_every=1",
    "wandb.mode=disabled",
]


class _TinyTarget(nn.Module):
    """Just enough of a HF causal LM for build/load: ``config`` sizes and an LM head."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.config = SimpleNamespace(hidden_size=hidden, vocab_size=vocab, num_hidden_layers=1)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


def _randomise(heads: nn.Module, std: float = 0.05) -> None:
    with torch.no_grad():
        for name, p in heads.named_parameters():
            if name.endswith("linear.weight"):
                p.normal_(0, std)


# -- pure / small tests ----------------------------------------------------------------------------


def test_default_tree_is_the_best_prefix_closed_set() -> None:
    from eval.proposers.medusa import default_tree_paths, rank_prior

    K, R, depth, top_k, total = 3, 4, 3, 3, 10
    g = torch.Generator().manual_seed(0)
    acc = torch.rand(K, R, generator=g) * 0.5
    paths = default_tree_paths(acc, total, depth, top_k)
    assert len(paths) == total and len({tuple(p) for p in paths}) == total
    chosen = {tuple(p) for p in paths}
    for p in paths:
        assert 1 <= len(p) <= depth and all(0 <= r < top_k for r in p)
        assert len(p) == 1 or tuple(p[:-1]) in chosen  # closed under prefixes

    # Brute force: the chosen nodes are exactly the `total` most valuable ones (value = product of accuracies).
    def value(p: tuple[int, ...]) -> float:
        return math.prod(float(acc[i, r]) for i, r in enumerate(p))

    every = [p for d in range(1, depth + 1) for p in itertools.product(range(top_k), repeat=d)]
    best = sorted(every, key=value, reverse=True)[:total]
    assert chosen == set(best)

    # It follows the measured accuracies: head 1's rank 2 and head 2's rank 1 are the best ranks here.
    acc = torch.full((2, 4), 0.01)
    acc[0, 2], acc[1, 1] = 0.9, 0.8
    assert default_tree_paths(acc, 2, 4, 4) == [[2], [2, 1]]
    small = default_tree_paths(acc, 10, 2, 2)  # tree_top_k=2, depth 2: only 2 + 4 candidate nodes
    assert len(small) == 6 and all(r < 2 for p in small for r in p)
    # Depth is capped by the number of heads; the prior (nothing measured) is deep along the top ranks.
    assert max(len(p) for p in default_tree_paths(rank_prior(2, 8), 50, 5, 8)) == 2
    prior_tree = default_tree_paths(rank_prior(4, 8), 16, 4, 8)
    assert prior_tree[:2] == [[0], [0, 0]] and [0, 0, 0] in prior_tree


def test_loss_matches_a_direct_computation_and_counts_ranks() -> None:
    from train.drafters import registry
    from train.drafters.registry import TargetFeatures, TrainBatch

    spec = registry.get("medusa")
    H, V, B, L = 8, 11, 2, 9
    target = _TinyTarget(H, V)
    cfg = spec.config_cls(num_heads=3, loss_decay=0.5, tree_top_k=4)
    torch.manual_seed(0)
    heads = spec.build(cfg, target)
    _randomise(heads, 0.5)
    ids = torch.randint(0, V, (B, L))
    attn = torch.ones(B, L, dtype=torch.long)
    attn[1, 6:] = 0
    loss_mask = torch.zeros(B, L, dtype=torch.long)
    loss_mask[:, 3:] = 1
    h = torch.randn(B, L, H)
    feats = TargetFeatures(layers={1: h}, num_layers=1, lm_head=target.lm_head)
    loss, m = spec.loss(heads, TrainBatch(ids, attn, loss_mask), feats, cfg)

    want = torch.zeros(())
    hits = torch.zeros(3, 4, dtype=torch.long)
    counts = []
    for k in range(1, 4):
        terms = []
        for b in range(B):
            for t in range(L - k - 1):
                if loss_mask[b, t + k + 1] and attn[b, t + k + 1]:
                    logits = target.lm_head(heads.heads[k - 1](h[b, t]))
                    terms.append(nn.functional.cross_entropy(logits[None], ids[b, t + k + 1][None]))
                    rank = int((logits > logits[ids[b, t + k + 1]]).sum())
                    if rank < 4:
                        hits[k - 1, rank] += 1
        want = want + 0.5 ** (k - 1) * torch.stack(terms).mean()
        counts.append(len(terms))
        if k == 1:
            assert float(m["tokens"]) == len(terms)
    assert torch.allclose(loss, want, atol=1e-5)
    assert torch.equal(heads.rank_hits, hits)
    assert heads.rank_count.tolist() == counts == [9, 9, 7]
    assert float(m["acc_top1_pos1"]) == float(m["acc_head1_top1"]) == hits[0, 0] / m["tokens"]
    assert {f"acc_head{k}_top{n}" for k in (1, 2, 3) for n in (1, 5)} <= m.keys()
    loss.backward()
    assert all(p.grad is not None for p in heads.parameters())

    # drafter.soft_labels: head k's CE against the target's distribution at t+k (over x[t+k+1]), same positions.
    soft_cfg = spec.config_cls(num_heads=3, loss_decay=0.5, tree_top_k=4, soft_labels=True)
    soft, m = spec.loss(heads, TrainBatch(ids, attn, loss_mask), feats, soft_cfg)
    want = torch.zeros(())
    for k in range(1, 4):
        terms = []
        for b in range(B):
            for t in range(L - k - 1):
                if loss_mask[b, t + k + 1] and attn[b, t + k + 1]:
                    logp = torch.log_softmax(target.lm_head(heads.heads[k - 1](h[b, t])), -1)
                    p = torch.softmax(target.lm_head(h[b, t + k]), -1)
                    terms.append(-(p * logp).sum())
        want = want + 0.5 ** (k - 1) * torch.stack(terms).mean()
    assert torch.allclose(soft, want, atol=1e-5) and not torch.allclose(soft, loss)
    assert float(m["tokens"]) == counts[0]


@pytest.mark.parametrize("own_lm_head", [False, True])
def test_save_load_round_trip_and_size_check(tmp_path: Path, own_lm_head: bool) -> None:
    from train.drafters import registry

    spec = registry.get("medusa")
    target = _TinyTarget(16, 40)
    cfg = spec.config_cls(num_heads=3, num_layers=2, own_lm_head=own_lm_head, tree_top_k=5)
    heads = spec.build(cfg, target)
    _randomise(heads)
    heads.rank_hits[:] = torch.arange(15).reshape(3, 5)
    heads.rank_count[:] = 100
    if own_lm_head:  # initialised from the target's LM head, then its own parameter
        assert torch.equal(heads.heads[2][2].weight, target.lm_head.weight)
        assert "heads.2.2.weight" in heads.state_dict()
    assert not any(k.startswith("lm_head") for k in heads.state_dict())
    assert "heads.1.1.linear.bias" in heads.state_dict()
    spec.save(heads, str(tmp_path / "d"), cfg)
    meta = json.loads((tmp_path / "d" / "config.json").read_text())
    assert meta["draftsmith"]["drafter"]["name"] == "medusa" and meta["hidden_size"] == 16
    loaded = spec.load(str(tmp_path / "d"), target, None)
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert torch.equal(heads.head_logits(x, target.lm_head), loaded.head_logits(x, target.lm_head))
    assert torch.equal(loaded.rank_hits, heads.rank_hits) and torch.equal(loaded.rank_count, heads.rank_count)
    for other in (_TinyTarget(8, 40), _TinyTarget(16, 41)):
        with pytest.raises(ValueError, match="hidden_size"):
            spec.load(str(tmp_path / "d"), other, None)
    state = load_file(str(tmp_path / "d" / "model.safetensors"))
    state.pop("heads.0.0.linear.bias")
    from safetensors.torch import save_file

    save_file(state, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        spec.load(str(tmp_path / "d"), target, None)


# -- the real target -------------------------------------------------------------------------------


@pytest.mark.parametrize("decode", ["chain", "tree"])
def test_medusa_proposer_is_lossless_on_the_real_target(target, decode: str) -> None:
    from eval.decoder import SpeculativeDecoder
    from train.drafters import registry

    spec = registry.get("medusa")
    cfg = spec.config_cls(decode=decode, num_heads=3, chain_k=4, tree_depth=3, tree_top_k=4, tree_total_tokens=10)
    torch.manual_seed(0)
    heads = spec.build(cfg, target.model).eval()
    _randomise(heads)  # a random (non-identity) head must still be lossless
    proposer = spec.proposer(heads, target.model, cfg)
    if decode == "tree":
        assert len(proposer.paths) == 10 and max(len(p) for p in proposer.paths) <= 3
    assert_greedy_identity(target, lambda: proposer, ("Write a Python function that reverses a string.",))
    # Sampling runs too (chain: sampled drafts with their q; tree: deterministic delta proposals).
    from data.render import prompt_ids

    tok = target.tokenizer
    ids = torch.tensor(
        [prompt_ids(tok, [{"role": "user", "content": "Write a Python function that reverses a string."}])]
    )
    sampler = SpeculativeDecoder(target.model, proposer, temperature=0.8)
    out = sampler.generate(ids, 8, eos_token_id=tok.eos_token_id, generator=torch.Generator().manual_seed(0))
    assert len(out.tokens) >= 1


def test_explicit_tree_paths_are_used_and_checked(target) -> None:
    from data.config import ConfigError
    from train.drafters import registry

    spec = registry.get("medusa")
    cfg = spec.config_cls(num_heads=2, tree_paths=[[0], [1], [0, 0], [0, 1]])
    heads = spec.build(cfg, target.model)
    assert spec.proposer(heads, target.model, cfg).paths == [[0], [1], [0, 0], [0, 1]]
    with pytest.raises(ConfigError, match="depth 3"):
        spec.build(spec.config_cls(num_heads=2, tree_paths=[[0], [0, 0], [0, 0, 0]]), target.model)
    with pytest.raises(ConfigError, match="no parent"):
        spec.build(spec.config_cls(tree_paths=[[0, 0]]), target.model)


# -- stage train -----------------------------------------------------------------------------------


def test_medusa_trains_logs_per_head_metrics_and_resumes_exactly(
    synth_dir: Path, tmp_path: Path, run_env: dict[str, str], target
) -> None:
    base = [*SMALL_SYNTH, "stage=train", f"synth_dir={synth_dir}", *TRAIN]
    one = tmp_path / "one"
    out = _ok(_run([*base, f"hydra.run.dir={one}"], run_env))
    losses = _losses(one)
    assert len(losses) == 4
    assert sum(losses[-2:]) < 0.85 * sum(losses[:2]), losses  # it learns
    for key in ("acc_head1_top1", "acc_head4_top5", "loss_head2", "acc_top1_pos1"):
        assert key in out, key  # per-head metrics in the step logs
    manifest = json.loads((one / "manifest.json").read_text())
    assert manifest["result"]["finished"]
    assert_best_is_best_check(manifest)
    best = one / "best"
    assert json.loads((best / "config.json").read_text())["draftsmith"]["drafter"]["name"] == "medusa"
    saved = load_file(str(best / "model.safetensors"))
    assert int(saved["rank_count"][0]) > 0 and int(saved["rank_hits"].sum()) > 0  # measured rank accuracies
    # The eval stage names (and costs) Medusa's chain by what it drafts: eval.k=5 with 4 heads drafts 4.
    from eval.run import build_methods
    from train.drafters.registry import load_drafter

    cfg = compose([*SMALL_SYNTH, "drafter=medusa", f"eval.drafter_dir={best}", "eval.k=5", "eval.decode=both"])
    cfg.eval.proposers = ["drafter"]
    methods = {m.name: m.k for m in build_methods(cfg, target, load_drafter)}
    assert methods == {"medusa_chain_k4": 4, "medusa_tree_n16": None}, methods

    # Two processes (torchrun, gloo), same global batch (grad_accum=1 each): the same losses and, after the
    # all-reduce of the rank counters, the same counts as one process that saw both micro-batches.
    two = tmp_path / "two"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29541"]
    _ok(_run([*base, "train.grad_accum=1", f"hydra.run.dir={two}"], run_env, launcher))
    assert _losses(two) == pytest.approx(losses, rel=1e-4)
    last = Path("checkpoints") / "step-000004" / "drafter" / "model.safetensors"
    c1, c2 = load_file(str(one / last)), load_file(str(two / last))
    assert int(c1["rank_count"][0]) > 0
    assert torch.equal(c2["rank_count"], c1["rank_count"]) and torch.equal(c2["rank_hits"], c1["rank_hits"])

    # Kill with SIGKILL once the step-2 checkpoint is complete, then resume=true: same end state.
    a, b = assert_kill_resume_exact(base, one, tmp_path / "killed", run_env, last_step=4)
    assert torch.equal(a["rank_hits"], b["rank_hits"]) and torch.equal(a["rank_count"], b["rank_count"])
