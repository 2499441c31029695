"""train.optimizer=muon: Muon on the hidden matrices, AdamW on the rest, in one optimizer.

Each group is checked step for step against torch's own optimizer (``torch.optim.Muon`` with speculators'
``match_rms_adamw`` adjustment, ``torch.optim.AdamW``), the split against speculators' rule, and a real EAGLE-3 run
on the real target with it (and a weight average): the loss falls and a killed run resumes exactly (the Muon momentum
and the average are checkpointed)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.test_train.runs import assert_kill_resume_exact
from tests.test_train.runs import losses as _losses
from tests.test_train.runs import ok as _ok
from tests.test_train.runs import run_train as _run
from train.config import TrainConfig
from train.optim import MuonAdamW, build_optimizer, orthogonalise, split_for_muon


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(50, 16)
        self.fc = nn.Linear(48, 16, bias=False)
        self.midlayer = nn.ModuleDict({"q_proj": nn.Linear(16, 24, bias=True), "up_proj": nn.Linear(16, 40)})
        self.norm = nn.LayerNorm(16)
        self.lm_head = nn.Linear(16, 50, bias=False)
        self.gate = nn.Parameter(torch.randn(1, 16))  # 2-D but a vector: AdamW
        self.embed_tokens.weight.requires_grad_(False)


def test_split_follows_speculators_rule() -> None:
    muon, adamw, names = split_for_muon(_Head())
    assert names == ["fc.weight", "midlayer.q_proj.weight", "midlayer.up_proj.weight"]
    assert len(muon) == 3 and all(p.ndim == 2 for p in muon)
    # biases, the norm, the vocabulary projection and the [1, N] vector; the frozen embedding is in neither
    assert len(adamw) == 6 and sum(p.numel() for p in adamw) == 24 + 40 + 16 + 16 + 16 * 50 + 16


def _grads(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_groups_step_like_torchs_muon_and_adamw(wd: float) -> None:
    torch.manual_seed(0)
    ours_model = _Head()
    ref_model = copy.deepcopy(ours_model)
    muon, adamw, _ = split_for_muon(ours_model)
    rmuon, radamw, _ = split_for_muon(ref_model)
    ours = MuonAdamW(
        muon,
        adamw,
        lr=2e-3,
        betas=(0.9, 0.95),
        weight_decay=wd,
        muon_lr=5e-3,
        muon_weight_decay=0.1,
        ns_dtype=torch.bfloat16,  # torch's dtype for the iteration
    )
    ref = [
        torch.optim.Muon(rmuon, lr=5e-3, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(radamw, lr=2e-3, betas=(0.9, 0.95), weight_decay=wd, foreach=False),
    ]
    sched = torch.optim.lr_scheduler.LambdaLR(ours, lambda s: 1.0 / (1 + s))  # one schedule scales both groups
    rsched = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in ref]
    for step in range(6):
        _grads(ours_model, step)
        _grads(ref_model, step)
        ours.step()
        for o in ref:
            o.step()
        sched.step()
        for s in rsched:
            s.step()
    moved = 0
    for (name, a), b, start in zip(
        ours_model.named_parameters(), ref_model.parameters(), _Head().parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
        moved += int(not torch.equal(a, start))
    assert moved >= 8
    assert ours.param_groups[0]["lr"] == pytest.approx(5e-3 / 7)
    assert ours.param_groups[1]["lr"] == pytest.approx(2e-3 / 7)


def test_state_dict_round_trip_continues_identically() -> None:
    torch.manual_seed(1)
    a_model = _Head()
    a = MuonAdamW(*split_for_muon(a_model)[:2], lr=1e-3)
    for step in range(3):
        _grads(a_model, step)
        a.step()
    b_model = copy.deepcopy(a_model)
    b = MuonAdamW(*split_for_muon(b_model)[:2], lr=1e-3)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    for step in range(3, 5):
        for m, o in ((a_model, a), (b_model, b)):
            _grads(m, step)
            o.step()
    for x, y in zip(a_model.parameters(), b_model.parameters(), strict=True):
        assert torch.equal(x, y)


def test_muon_is_refused_under_deepspeed_zero() -> None:
    cfg = TrainConfig(optimizer="muon")  # type: ignore[arg-type]
    opt, line = build_optimizer(_Head(), cfg, torch.device("cpu"))
    assert isinstance(opt, MuonAdamW) and line.startswith("Muon on 3 matrices")
    with pytest.raises(ValueError, match="DeepSpeed ZeRO flattens"):
        build_optimizer(_Head(), cfg, torch.device("cpu"), deepspeed=True)
    assert isinstance(
        build_optimizer(_Head(), TrainConfig(), torch.device("cpu"), deepspeed=True)[0], torch.optim.AdamW
    )


def test_fp32_iteration_orthogonalises() -> None:
    g = torch.randn(24, 40, generator=torch.Generator().manual_seed(2))
    s = torch.linalg.svdvals(orthogonalise(g, 5, torch.float32))
    assert s.min() > 0.5 and s.max() < 1.3  # Newton-Schulz's quintic: singular values pushed into ~[0.7, 1.2]
    ref = torch.linalg.svdvals(orthogonalise(g, 5, torch.bfloat16).float())
    torch.testing.assert_close(s, ref, rtol=0.05, atol=0.02)


@pytest.mark.slow
def test_eagle3_trains_with_muon_and_a_weight_average_and_resumes_exactly(
    synth_dir: Path, tmp_path: Path, run_env: dict[str, str]
) -> None:
    """A real EAGLE-3 run with Muon and train.ema_decay (the quickstart averages its weights): the loss falls, the
    saved drafter holds the averaged weights (not the optimizer's), and a run killed after a checkpoint resumes
    exactly (the Muon momentum and the average are both in the checkpoint)."""
    from safetensors.torch import load_file

    from tests.test_train.test_eagle3 import _train_args

    base = [*_train_args(synth_dir), "train.optimizer=muon", "train.ema_decay=0.9"]
    one = tmp_path / "one"
    out = _ok(_run([*base, f"hydra.run.dir={one}"], run_env))
    assert "optimizer: Muon on 8 matrices" in out and "fc.weight" in out, out[-3000:]
    losses = _losses(one)
    assert len(losses) == 6 and sum(losses[-2:]) < 0.85 * sum(losses[:2]), losses
    adamw = tmp_path / "adamw"
    _ok(_run([*_train_args(synth_dir), f"hydra.run.dir={adamw}"], run_env))
    assert _losses(adamw)[0] == pytest.approx(losses[0], rel=1e-6)  # same start, other optimizer
    assert abs(_losses(adamw)[3] - losses[3]) > 1e-3 * losses[3]

    ckpt = one / "checkpoints" / "step-000006"
    raw = load_file(str(ckpt / "state" / "model.safetensors"))
    saved = load_file(str(ckpt / "drafter" / "model.safetensors"))
    shadows = [torch.load(f, weights_only=True) for f in sorted((ckpt / "state").glob("custom_checkpoint_*.pkl"))]
    shadow = next(s["shadow"] for s in shadows if "shadow" in s)
    assert next(s["updates"] for s in shadows if "shadow" in s) == 6
    for k in ("fc.weight", "midlayer.mlp.down_proj.weight"):
        assert torch.allclose(saved[k].float(), shadow[k], atol=1e-7), k
        assert not torch.allclose(saved[k].float(), raw[k].float(), atol=1e-5), k
    assert_kill_resume_exact(base, one, tmp_path / "killed", run_env, last_step=6)


def test_weight_average_warmup_sets_how_fast_the_decay_ramps() -> None:
    """train.ema_warmup: after n updates the average's decay is min(ema_decay, (1 + n) / (ema_warmup + n)); at the
    default 10 a short run's average ignores ema_decay, at 1 the decay is ema_decay from the first update; values
    below 1 are refused."""
    from data.config import ConfigError
    from train.config import Config
    from train.loop import WeightAverage, validate_train

    def shadow_after(decay: float, warmup: float, updates: int) -> float:
        m = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            m.weight.zero_()
        avg = WeightAverage(m, decay, warmup)
        with torch.no_grad():
            m.weight.fill_(1.0)
        for _ in range(updates):
            avg.update(m)
        return float(avg.shadow["weight"])

    assert shadow_after(0.98, 10.0, 1) == pytest.approx(1 - 2 / 11)  # the ramp, not 0.98
    assert shadow_after(0.98, 1.0, 1) == pytest.approx(0.02)  # ema_decay from the start
    # at the default ramp, 0.98 and 0.99 are the same average until the ramp reaches 0.98 (440 updates)
    assert shadow_after(0.98, 10.0, 150) == shadow_after(0.99, 10.0, 150)
    assert shadow_after(0.98, 2.0, 150) != pytest.approx(shadow_after(0.99, 2.0, 150), abs=1e-6)
    cfg = Config()
    cfg.train.ema_warmup = 0.5
    with pytest.raises(ConfigError, match=r"ema_warmup=0\.5 must be >= 1"):
        validate_train(cfg)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("save_every", 0, r"train\.save_every=0 must be >= 1"),
        ("log_every", 0, r"train\.log_every=0 must be >= 1"),
        ("keep_checkpoints", 0, r"train\.keep_checkpoints=0 must be >= 1"),
        ("eval_every", -1, r"train\.eval_every=-1 must be >= 0"),
        # a run that could never finish: all steps, then the final held-out check had nothing to check
        ("eval_prompts", 0, r"train\.eval_prompts=0 must be >= 1"),
        ("eval_max_new_tokens", 0, r"train\.eval_max_new_tokens=0 must be >= 1"),
        ("max_seq_len", 0, r"train\.max_seq_len=0 must be >= 8"),
        ("warmup_steps", -5, r"train\.warmup_steps=-5 must be >= 0"),
        ("beta2", 1.0, r"train\.beta2=1\.0 must be in \[0, 1\)"),
        ("min_lr_ratio", 2.0, r"train\.min_lr_ratio=2\.0 must be in \[0, 1\]"),
        ("stop_after_steps", 0, r"train\.stop_after_steps=0 must be >= 1"),
    ],
)
def test_step_intervals_are_refused_before_training(key: str, value: int, message: str) -> None:
    """An interval of 0 used to reach the loop (``step % 0``: a ZeroDivisionError after the first step's work) and
    ``keep_checkpoints=0`` would delete every checkpoint, the last one included; both are refused up front."""
    from data.config import ConfigError
    from train.config import Config
    from train.loop import validate_train

    cfg = Config()  # no drafter chosen: validate_train always raises, the defaults' intervals are not named
    with pytest.raises(ConfigError) as default:
        validate_train(cfg)
    assert f"train.{key}=" not in str(default.value)
    setattr(cfg.train, key, value)
    with pytest.raises(ConfigError, match=message):
        validate_train(cfg)
