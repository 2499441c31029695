"""Stage train with the EAGLE head on the real target: loss falls, 2 processes == 1 process (plain accelerate, DDP
across processes: the default deepspeed=none; DeepSpeed engines are tests/test_train/test_deepspeed.py's),
kill-and-resume == uninterrupted, and the EAGLE proposer is lossless (chain and tree)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import SMALL_SYNTH
from tests.derived import assert_best_is_best_check
from tests.test_train.runs import assert_greedy_identity, assert_kill_resume_exact
from tests.test_train.runs import losses as _losses
from tests.test_train.runs import ok as _ok
from tests.test_train.runs import run_train as _run

pytestmark = pytest.mark.slow

EAGLE1 = [*SMALL_SYNTH, "drafter=eagle"]
"""The quickstart's data with the EAGLE-1 head these tests are about (the quickstart itself trains EAGLE-3)."""
TRAIN = [
    "train.features=online",
    "train.max_steps=6",
    "train.micro_batch_size=2",
    "train.lr=1e-3",
    "train.warmup_steps=1",
    "train.save_every=2",
    "train.eval_every=0",
    "train.eval_prompts=1",
    "train.eval_max_new_tokens=8",
    "train.log_every=1",
    "wandb.mode=disabled",
]


def test_loss_falls_two_processes_match_and_resume_is_exact(
    synth_dir: Path, tmp_path: Path, run_env: dict[str, str]
) -> None:
    base = [*EAGLE1, "stage=train", f"synth_dir={synth_dir}", *TRAIN]
    # One process, global batch = 2 micro-batches (grad_accum=2).
    one = tmp_path / "one"
    _ok(_run([*base, "train.grad_accum=2", f"hydra.run.dir={one}"], run_env))
    losses = _losses(one)
    assert len(losses) == 6
    assert sum(losses[-2:]) < 0.85 * sum(losses[:2]), losses  # it learns
    manifest = json.loads((one / "manifest.json").read_text())
    assert manifest["result"]["finished"] and manifest["result"]["train_tokens_per_second"] > 0
    assert_best_is_best_check(manifest)  # held-out tau measured at the end picks "best"
    assert (one / "best" / "model.safetensors").is_file()

    # Two processes (torchrun, gloo, DDP), same global batch (grad_accum=1 each).
    # Each step sees the same two micro-batches; only the order of the fp32 gradient sum differs, so the
    # losses agree to float32 rounding (we allow 1e-4 relative).
    two = tmp_path / "two"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533"]
    _ok(_run([*base, "train.grad_accum=1", f"hydra.run.dir={two}"], run_env, launcher))
    assert _losses(two) == pytest.approx(losses, rel=1e-4)

    # Kill with SIGKILL once the step-2 checkpoint is complete; a plain rerun is refused; resume=true: same end.
    assert_kill_resume_exact([*base, "train.grad_accum=2"], one, tmp_path / "killed", run_env, last_step=6)


@pytest.mark.parametrize("decode", ["chain", "tree"])
def test_eagle_proposer_is_lossless_on_the_real_target(target, decode: str) -> None:
    from train.drafters import registry

    spec = registry.get("eagle")
    cfg = spec.config_cls(decode=decode, chain_k=4, tree_depth=4, tree_top_k=3, tree_total_tokens=10)
    torch.manual_seed(0)
    head = spec.build(cfg, target.model).eval()
    # A random head must still be lossless: perturb the weights so drafts are arbitrary.
    with torch.no_grad():
        head.fc.weight.normal_(0, 0.02)
    assert_greedy_identity(
        target,
        lambda: spec.proposer(head, target.model, cfg),
        ("Write a Python function that reverses a string.", "Name three colours."),
    )


def test_loss_on_prompt_and_feature_noise_change_only_what_they_claim(target) -> None:
    """drafter.loss_on_prompt counts every real position (the target's feature and distribution after each prompt
    token), not only where the token two ahead is target-written; drafter.feature_noise noises the head's input
    features in training only (in eval the loss is the noise-free one), reproducibly under the same seed."""
    from train.drafters import registry
    from train.drafters.eagle import loss_fn
    from train.drafters.registry import TargetFeatures, TrainBatch

    ids = target.tokenizer("Question: what is two plus three? Answer: two plus three is five.", return_tensors="pt")
    ids = ids.input_ids
    with torch.no_grad():
        last = target.model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    feats = TargetFeatures({30: last}, 30, target.model.get_output_embeddings())
    am = torch.ones_like(ids)
    lm = torch.cat([am[:, :8] * 0, am[:, 8:]], 1)  # an 8-token prompt
    batch = TrainBatch(ids, am, lm)
    spec = registry.get("eagle")

    def loss(train: bool, **kw) -> tuple[float, int]:  # both options off unless asked (they are on by default)
        cfg = spec.config_cls(**{"loss_on_prompt": False, "feature_noise": 0.0, **kw})
        torch.manual_seed(0)
        head = spec.build(cfg, target.model).float().train(train)
        torch.manual_seed(1)
        out, metrics = loss_fn(head, batch, feats, cfg)
        return float(out.detach()), int(metrics["tokens"])

    plain, n = loss(True)
    assert n == int(lm[:, 2:].sum())
    on_prompt, n_all = loss(True, loss_on_prompt=True)
    assert n_all == ids.shape[1] - 2 and on_prompt != plain
    assert loss(False, feature_noise=0.3) == loss(False)  # eval: no noise
    noised = loss(True, feature_noise=0.3)
    assert noised == loss(True, feature_noise=0.3) and abs(noised[0] - plain) > 1e-4
    assert noised[1] == n


def test_precomputed_features_train_like_online(synth_dir: Path, tmp_path: Path, run_env: dict[str, str]) -> None:
    """stage=features writes the target's hidden states once; training on them matches online features."""
    feats = tmp_path / "features"
    args = [*EAGLE1, "stage=features", f"synth_dir={synth_dir}", f"hydra.run.dir={feats}", "wandb.mode=disabled"]
    out = _ok(_run(args, run_env))
    assert "MB on disk" in out  # the size is announced before the work starts
    manifest = json.loads((feats / "manifest.json").read_text())
    assert manifest["layers"] == [30] and manifest["rows"] == 12 and list(feats.glob("part-*.safetensors"))
    base = [*EAGLE1, "stage=train", f"synth_dir={synth_dir}", *TRAIN, "train.max_steps=3", "deepspeed=none"]
    online, pre = tmp_path / "online", tmp_path / "pre"
    _ok(_run([*base, f"hydra.run.dir={online}"], run_env))
    _ok(_run([*base, f"hydra.run.dir={pre}", "train.features=precomputed", f"train.features_dir={feats}"], run_env))
    assert _losses(pre) == pytest.approx(_losses(online), rel=1e-4)
    # train.max_rows (the scaling study's data-volume axis): the same features, only the first rows are trained on
    sub = tmp_path / "sub"
    pre_features = ["train.features=precomputed", f"train.features_dir={feats}"]
    out = _ok(_run([*base, f"hydra.run.dir={sub}", *pre_features, "train.max_rows=2"], run_env))
    assert "training on 2 of 12 rows, drawn at random" in out and "2 rows, 1 micro-batches/epoch" in out
    assert json.loads((sub / "manifest.json").read_text())["result"]["train_rows"] == 2
    assert json.loads((pre / "manifest.json").read_text())["result"]["train_rows"] == 12
    assert _losses(sub) != pytest.approx(_losses(pre), rel=1e-4)  # other rows, other losses
    proc = _run([*base, f"hydra.run.dir={tmp_path / 'too_many'}", *pre_features, "train.max_rows=13"], run_env)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode != 0 and "train.max_rows=13 but" in out and "has only 12 training rows" in out


def test_gradient_clipping_applies_on_cpu(synth_dir: Path, tmp_path: Path, run_env: dict[str, str]) -> None:
    """Without DeepSpeed (the default deepspeed=none) the run says so (log and manifest) and the loop clips the
    gradients itself, so train.max_grad_norm changes the training (CPU runs once ignored it)."""
    base = [*EAGLE1, "stage=train", f"synth_dir={synth_dir}", *TRAIN, "train.max_steps=3", "train.lr=1e-2"]
    runs = {}
    for name, clip in (("off", "0"), ("tiny", "1e-6")):
        runs[name] = tmp_path / name
        out = _ok(_run([*base, f"train.max_grad_norm={clip}", f"hydra.run.dir={runs[name]}"], run_env))
        assert "accelerate (no DeepSpeed)" in out
        assert json.loads((runs[name] / "manifest.json").read_text())["result"]["engine"] == "accelerate (no DeepSpeed)"
    off, tiny = _losses(runs["off"]), _losses(runs["tiny"])
    assert off[0] == pytest.approx(tiny[0], rel=1e-6)  # the same start ...
    assert abs(off[2] - tiny[2]) > 1e-3 * abs(off[2]), (off, tiny)  # ... then a clipped (near-frozen) head differs
