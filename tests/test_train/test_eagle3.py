"""EAGLE-3 on the real target: TTT matches inference, d2t/t2d from the data and checked on load, training
falls and resumes exactly, and the proposer is lossless (chain and tree)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import SMALL_SYNTH
from tests.test_train.runs import assert_greedy_identity, assert_kill_resume_exact
from tests.test_train.runs import losses as _losses
from tests.test_train.runs import ok as _ok
from tests.test_train.runs import run_train as _run
from tests.test_train.test_eagle_train import TRAIN
from train.drafters.eagle3 import NORM_FLAGS

pytestmark = pytest.mark.slow


def _head(target, **kw):  # -> (spec, cfg, head)
    """A head on the real target; the training options that are on by default (prompt loss, feature noise) off
    unless asked, so that each test sees only the option it checks."""
    from train.drafters import registry

    spec = registry.get("eagle3")
    cfg = spec.config_cls(**{"loss_on_prompt": False, "feature_noise": 0.0, **kw})
    torch.manual_seed(0)
    return spec, cfg, spec.build(cfg, target.model).float().eval()


def test_default_layers_and_feature_layers(target) -> None:
    from train.drafters import registry

    spec = registry.get("eagle3")
    cfg = spec.config_cls()
    assert spec.feature_layers(cfg, target.model.config) == [2, 15, 27, 30]  # vLLM's (2, N//2, N-3) + the last
    from data.config import ConfigError

    with pytest.raises(ConfigError, match="layer_ids"):
        spec.build(spec.config_cls(layer_ids=[2, 15, 31]), target.model)


def test_layer_ids_are_the_heads_own_and_saved(target, tmp_path) -> None:
    """Non-default layers are a constructor argument of the head, saved in config.json and read back by load
    (nothing is hung on the module afterwards: no probe, no hidden target reference)."""
    import json

    spec, cfg, head = _head(target, layer_ids=[3, 10, 20], draft_vocab_size=256)
    assert head.layer_ids == [3, 10, 20] and head.fc.in_features == 3 * target.model.config.hidden_size
    assert not [k for k in vars(head) if k.startswith("_target") or k.startswith("_draftsmith")]
    spec.save(head, str(tmp_path / "h"), cfg)
    meta = json.loads((tmp_path / "h" / "config.json").read_text())
    assert meta["draftsmith"]["layer_ids"] == [3, 10, 20] == meta["eagle_aux_hidden_state_layer_ids"]
    assert spec.load(str(tmp_path / "h"), target.model, None).layer_ids == [3, 10, 20]


def test_a_head_saved_before_a_key_existed_loads_with_what_it_was_trained_with(target, tmp_path) -> None:
    """The norms, prompt loss and feature noise are on by default now; a head whose config.json predates those keys
    (saved without the norms) still loads without them -- eval and export use the math it was trained with, and
    its weights load with nothing missing -- while a current save round-trips its own values."""
    from train.drafters import registry

    spec = registry.get("eagle3")
    assert spec.config_cls().norm_before_fc and spec.config_cls().feature_noise > 0
    _, cfg, head = _head(target, draft_vocab_size=256, **dict.fromkeys(NORM_FLAGS, False))
    spec.save(head, str(tmp_path / "old"), cfg)
    meta = json.loads((tmp_path / "old" / "config.json").read_text())
    for key in (*NORM_FLAGS, "loss_on_prompt", "feature_noise"):
        meta["draftsmith"]["drafter"].pop(key)
    (tmp_path / "old" / "config.json").write_text(json.dumps(meta))
    _, loaded, dcfg = registry.load_drafter(str(tmp_path / "old"), target)
    assert loaded.input_norm is None and not dcfg.norm_before_fc and not dcfg.loss_on_prompt
    assert dcfg.feature_noise == 0.0
    cfg = spec.config_cls(draft_vocab_size=256)
    spec.save(spec.build(cfg, target.model), str(tmp_path / "new"), cfg)
    _, loaded, dcfg = registry.load_drafter(str(tmp_path / "new"), target)
    assert loaded.input_norm is not None and dcfg.norm_output and dcfg.feature_noise == 0.3


@pytest.mark.parametrize(
    ("norms", "window"), [(False, None), (True, None), (True, 6)], ids=["plain", "norms", "window"]
)
def test_ttt_step_equals_inference_drafting(target, norms: bool, window: int | None) -> None:
    """Entry t of TTT step 1 must be exactly what the head computes when it drafts one token after committing
    rows 0..t at inference (own feature, own key at position t+1, the committed keys at positions <= t); with
    speculators' three optional norms too, and with a sliding window of 6 (training's TTT masks and inference's
    cache then both see only the keys within 6 positions of each query)."""
    from train.drafters.eagle3 import ttt_mask

    _, _, head = _head(target, draft_vocab_size=1024, sliding_window=window, **dict.fromkeys(NORM_FLAGS, norms))
    assert head.midlayer.self_attn.window == window
    assert (head.input_norm is not None) == norms and head.midlayer.norm_before_residual == norms
    ids = target.tokenizer("def add(a, b):\n    return a + b\n\nprint(add(2, 3))", return_tensors="pt").input_ids
    with torch.no_grad():
        hs = target.model(input_ids=ids, output_hidden_states=True).hidden_states
        fused = torch.cat([hs[i] for i in (2, 15, 27)], -1)
        T = ids.shape[1] - 1
        pos = torch.arange(T)[None]
        h0, kv0 = head(fused[:, :T], ids[:, 1:], pos, mask=ttt_mask(T, 0, "cpu")[None, None])
        nxt = torch.cat([ids[:, 2:], ids[:, -1:]], 1)
        h1, kv1 = head(h0, nxt, pos + 1, past=kv0, mask=ttt_mask(T, 1, "cpu")[None, None])
        nxt2 = torch.cat([nxt[:, 1:], nxt[:, -1:]], 1)
        h2, _ = head(h1, nxt2, pos + 2, past=kv1, mask=ttt_mask(T, 2, "cpu")[None, None])
        for t in (1, 4, T - 4):
            c, kv = head(fused[:, : t + 1], ids[:, 1 : t + 2], torch.arange(t + 1)[None])
            d1, kv = head(c[:, -1:], ids[:, t + 2 : t + 3], torch.tensor([[t + 1]]), past=kv)
            d2, _ = head(d1, ids[:, t + 3 : t + 4], torch.tensor([[t + 2]]), past=kv)
            scale = h1[0, t].abs().max()
            assert torch.allclose(c[0, -1], h0[0, t], atol=1e-4 * scale)
            assert torch.allclose(d1[0, 0], h1[0, t], atol=1e-4 * scale)
            assert torch.allclose(d2[0, 0], h2[0, t], atol=1e-4 * h2[0, t].abs().max())
    if window is not None:  # the window is in force: without it the same weights give other states far in
        head.midlayer.self_attn.window = None
        with torch.no_grad():
            full, _ = head(fused[:, :T], ids[:, 1:], pos, mask=ttt_mask(T, 0, "cpu")[None, None])
        head.midlayer.self_attn.window = window
        assert torch.allclose(full[0, : window - 1], h0[0, : window - 1], atol=1e-5)  # within reach: the same
        assert not torch.allclose(full[0, T - 4], h0[0, T - 4], atol=1e-3)
    # and a wrong mask (step 1 seeing step 0's keys of *later* entries) gives something else
    bad = torch.ones(T, 2 * T, dtype=torch.bool)
    with torch.no_grad():
        h1_bad, _ = head(h0, nxt, pos + 1, past=kv0, mask=bad[None, None])
    assert not torch.allclose(h1_bad[0, 1], h1[0, 1], atol=1e-3)


def test_vocab_from_data_and_corrupt_maps_refused(target, tmp_path: Path) -> None:
    from train.batches import Row
    from train.drafters.vocab import build_vocab, check_vocab_maps

    rows = [Row([5, 7, 7, 9, 9, 9, 3], [0, 0, 1, 1, 1, 1, 0]), Row([9, 11, 12], [0, 1, 1])]
    ids, info = build_vocab(rows, 50, 4)
    # written counts: 9 x4, 7 x1, 11 x1, 12 x1 -> top 4 by count then id: 9, 7, 11, 12 (sorted ascending)
    assert ids.tolist() == [7, 9, 11, 12] and info["target_written_token_coverage"] == 1.0
    ids, info = build_vocab(rows, 50, 6)  # topped up with prompt tokens by frequency: 3, 5
    assert ids.tolist() == [3, 5, 7, 9, 11, 12]

    spec, cfg, head = _head(target, draft_vocab_size=512)
    info = spec.prepare(head, [Row(list(range(1000, 1600)), [1] * 600)], cfg, target.model)
    assert head.t2d.sum() == 512 and head.target_ids().tolist() == list(range(1000, 1512))
    assert torch.equal(head.lm_head.weight, target.model.get_output_embeddings().weight[1000:1512])
    out = tmp_path / "head"
    spec.save(head, str(out), cfg)
    loaded = spec.load(str(out), target.model, cfg)
    x = torch.randn(3, target.model.config.hidden_size)
    assert torch.equal(loaded.full_logits(x), head.full_logits(x))
    assert torch.isinf(head.full_logits(x)[:, :1000]).all()

    state = load_file(str(out / "model.safetensors"))
    for name, bad, msg in [
        ("zeros", {"d2t": torch.zeros_like(state["d2t"])}, "t2d does not mark"),
        ("shifted", {"d2t": state["d2t"] + 1, "t2d": torch.roll(state["t2d"], 1)}, "does not match the vocabulary"),
        ("dup", {"d2t": torch.cat([state["d2t"][:1] + 1, state["d2t"][1:]])}, "strictly increasing"),
        ("range", {"d2t": state["d2t"] + 60000}, "outside the target vocabulary"),
        ("short", {"d2t": state["d2t"][:-1]}, "int64"),
    ]:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text((out / "config.json").read_text())
        save_file({**state, **bad}, str(d / "model.safetensors"))
        with pytest.raises(ValueError, match=msg):
            spec.load(str(d), target.model, cfg)
    with pytest.raises(ValueError, match="corrupt"):
        check_vocab_maps(state["d2t"].float(), state["t2d"], 512, target.model.config.vocab_size)


@pytest.mark.parametrize("decode", ["chain", "tree"])
def test_eagle3_proposer_is_lossless_on_the_real_target(target, decode: str) -> None:
    from train.batches import Row

    spec, cfg, head = _head(
        target, decode=decode, chain_k=4, tree_depth=4, tree_top_k=3, tree_total_tokens=10, draft_vocab_size=4096
    )
    spec.prepare(
        head, [Row(list(range(0, 8192, 2)), [1] * 4096)], cfg, target.model
    )  # a vocabulary that misses half the ids
    with torch.no_grad():
        head.fc.weight.normal_(0, 0.02)
    assert_greedy_identity(
        target,
        lambda: spec.proposer(head, target.model, cfg),
        ("Write a Python function that reverses a string.", "Name three colours."),
    )


def _train_args(synth_dir: Path) -> list[str]:
    return [
        *SMALL_SYNTH,
        "stage=train",
        f"synth_dir={synth_dir}",
        *TRAIN,
        "drafter=eagle3",
        "drafter.draft_vocab_size=1024",
        "drafter.ttt_steps=2",
        "deepspeed=none",
        "train.lr=3e-3",
    ]


def test_eagle3_trains_and_resumes_exactly(synth_dir: Path, tmp_path: Path, run_env: dict[str, str]) -> None:
    base = _train_args(synth_dir)
    one = tmp_path / "one"
    _ok(_run([*base, f"hydra.run.dir={one}"], run_env))
    losses = _losses(one)
    assert len(losses) == 6 and sum(losses[-2:]) < 0.85 * sum(losses[:2]), losses
    manifest = json.loads((one / "manifest.json").read_text())
    data = manifest["result"]["drafter_data"]
    assert data["draft_vocab_size"] == 1024 and 0.9 < data["target_written_token_coverage"] <= 1.0
    best = one / "best"
    cfg_json = json.loads((best / "config.json").read_text())
    assert cfg_json["draft_vocab_size"] == 1024 and cfg_json["draftsmith"]["d2t_hash"] == data["d2t_hash"]
    assert "embed_tokens.weight" not in load_file(str(best / "model.safetensors"))

    assert_kill_resume_exact(base, one, tmp_path / "killed", run_env, last_step=6)


def test_bf16_autocast_runs_the_draft_in_bf16_and_keeps_the_teacher_in_float32(target) -> None:
    """Under a bf16 autocast (what train.dtype=bfloat16 puts around the loss), the draft's vocabulary-wide products
    (its LM head, called outside the module's forward) run in bf16, while the teacher's projection onto the draft
    vocabulary stays float32; the loss is close to the float32 one but not equal."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from train.batches import Row
    from train.drafters.registry import TargetFeatures, TrainBatch

    spec, cfg, head = _head(target, draft_vocab_size=512, ttt_steps=2, loss_all_positions=True)
    ids = target.tokenizer("def add(a, b):\n    return a + b\n\nprint(add(2, 3))", return_tensors="pt").input_ids
    spec.prepare(head, [Row(ids[0].tolist(), [0] * 4 + [1] * (ids.shape[1] - 4))], cfg, target.model)
    with torch.no_grad():
        hs = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    feats = TargetFeatures({i: hs[i] for i in (2, 15, 27, 30)}, 30, target.model.get_output_embeddings())
    mask = torch.ones_like(ids)
    batch = TrainBatch(ids, mask, torch.cat([mask[:, :4] * 0, mask[:, 4:]], 1))

    class Products(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[torch.dtype, int]] = []  # (dtype, output width) of every matrix product

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
                self.seen.append((out.dtype, int(out.shape[-1])))
            return out

    with torch.no_grad():
        ref = float(spec.loss(head, batch, feats, cfg)[0])
    products = Products()
    with products, torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = float(spec.loss(head, batch, feats, cfg)[0])
    vocab_wide = [dt for dt, width in products.seen if width == 512]
    # the teacher's projection (once) in float32, the draft's LM head (once per TTT step) in bf16
    assert vocab_wide.count(torch.float32) == 1 and vocab_wide.count(torch.bfloat16) == cfg.ttt_steps, vocab_wide
    assert got != ref and got == pytest.approx(ref, rel=2e-2)


def test_frozen_draft_lm_head_keeps_the_targets_rows(target) -> None:
    """drafter.freeze_lm_head: the draft LM head holds the target's rows of the draft vocabulary and gets no
    gradient (the optimizer only sees parameters that require one); everything else still trains."""
    from train.batches import Row
    from train.drafters.registry import TargetFeatures, TrainBatch

    spec, cfg, head = _head(target, draft_vocab_size=512, freeze_lm_head=True, ttt_steps=2)
    ids = target.tokenizer("def add(a, b):\n    return a + b\n\nprint(add(2, 3))", return_tensors="pt").input_ids
    spec.prepare(head, [Row(ids[0].tolist(), [0] * 4 + [1] * (ids.shape[1] - 4))], cfg, target.model)
    rows = head.target_ids()
    assert torch.equal(head.lm_head.weight, target.model.get_output_embeddings().weight[rows])
    assert not head.lm_head.weight.requires_grad
    with torch.no_grad():
        hs = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    feats = TargetFeatures({i: hs[i] for i in (2, 15, 27, 30)}, 30, target.model.get_output_embeddings())
    mask = torch.ones_like(ids)
    head.train()
    loss, _ = spec.loss(head, TrainBatch(ids, mask, torch.cat([mask[:, :4] * 0, mask[:, 4:]], 1)), feats, cfg)
    loss.backward()
    assert head.lm_head.weight.grad is None
    assert head.fc.weight.grad is not None and head.fc.weight.grad.abs().sum() > 0


def test_norm_from_target_makes_the_initial_draft_logits_the_targets(target) -> None:
    """drafter.init_norm_from_target: the head's final norm starts at the target's, so that at initialisation the
    draft logits of a pre-norm feature are the target's own logits on the draft vocabulary (the LM head starts at
    the target's rows); by default the norm starts at ones and they are not. A target without a final norm is
    refused with a clear error."""
    from data.config import ConfigError
    from train.drafters.eagle3 import final_norm

    tnorm = final_norm(target.model)
    h = torch.randn(2, 5, target.model.config.hidden_size) * 3
    with torch.no_grad():
        want = target.model.get_output_embeddings()(tnorm(h))
    for flag in (True, False):
        spec, _cfg, head = _head(target, draft_vocab_size=512, init_norm_from_target=flag, norm_output=False)
        with torch.no_grad():
            got = head.draft_logits(h)
        close = torch.allclose(got, want[..., head.target_ids()], atol=1e-4, rtol=1e-4)
        assert close == flag
        assert torch.equal(head.norm.weight, tnorm.weight if flag else torch.ones_like(tnorm.weight))

    class NoNorm(torch.nn.Module):
        config = target.model.config

        def get_decoder(self) -> torch.nn.Module:
            return torch.nn.Identity()

        def get_input_embeddings(self) -> torch.nn.Module:
            return target.model.get_input_embeddings()

        def get_output_embeddings(self) -> torch.nn.Module:
            return target.model.get_output_embeddings()

    with pytest.raises(ConfigError, match="final norm"):
        spec.build(spec.config_cls(draft_vocab_size=512, init_norm_from_target=True), NoNorm())


def test_draft_layer_can_start_from_a_target_layer(target) -> None:
    """drafter.init_layer_from_target=i: the draft layer starts as the target's decoder layer i (MLP, norms, o_proj,
    and its q/k/v acting on the feature half of the 2H-wide input), so on a zero embedding half its attention
    projections and MLP compute the target layer's; by default (None) they do not; an index outside the target's
    layers is refused."""
    from data.config import ConfigError

    layers = target.model.get_decoder().layers
    H = target.model.config.hidden_size
    x = torch.randn(3, H)
    xin = torch.cat([torch.zeros(3, H), x], dim=-1)
    for index in (-1, 15, None):
        _spec, _cfg, head = _head(target, draft_vocab_size=512, init_layer_from_target=index)
        mid = head.midlayer
        src = layers[index if index is not None else -1]
        with torch.no_grad():
            same = [
                torch.allclose(getattr(mid.self_attn, n)(xin), getattr(src.self_attn, n)(x), atol=1e-5)
                for n in ("q_proj", "k_proj", "v_proj")
            ]
            same.append(torch.allclose(mid.mlp(x), src.mlp(x), atol=1e-5))
            same.append(torch.equal(mid.hidden_norm.weight, src.input_layernorm.weight))
        assert all(same) if index is not None else not any(same[:4])
    with pytest.raises(ConfigError, match="init_layer_from_target=30"):
        _head(target, draft_vocab_size=512, init_layer_from_target=30)


def test_dropout_acts_in_training_only(target) -> None:
    """drafter.dropout=p: in training mode two forwards of the same input differ (dropout on the draft layer's
    attention and MLP outputs); in eval mode the head computes exactly what a head without dropout computes (the
    same weights), so drafting and export are unchanged; p outside [0, 1) is refused."""
    from data.config import ConfigError

    H = target.model.config.hidden_size
    feats = torch.randn(2, 6, 3 * H)
    ids = torch.randint(0, 500, (2, 6))
    pos = torch.arange(6).expand(2, 6)
    _spec, _cfg, plain = _head(target, draft_vocab_size=512)
    _spec, _cfg, head = _head(target, draft_vocab_size=512, dropout=0.2)
    head.load_state_dict(plain.state_dict())
    with torch.no_grad():
        assert torch.equal(head(feats, ids, pos)[0], plain(feats, ids, pos)[0])  # eval mode: no dropout
        head.train()
        a, b = head(feats, ids, pos)[0], head(feats, ids, pos)[0]
        assert not torch.allclose(a, b)
        plain.train()
        assert torch.equal(plain(feats, ids, pos)[0], plain(feats, ids, pos)[0])  # p = 0: deterministic
    with pytest.raises(ConfigError, match="dropout"):
        _head(target, draft_vocab_size=512, dropout=1.0)


@pytest.mark.parametrize("loss_all_positions", [False, True])
def test_teacher_temperature_divides_the_targets_logits(target, loss_all_positions: bool) -> None:
    """drafter.teacher_temperature=T: the loss at T equals the loss at 1 against a target whose LM head is divided
    by T (the teacher is softmax(logits / T)); it differs from T=1, and T <= 0 is refused."""
    from data.config import ConfigError
    from train.batches import Row
    from train.drafters.registry import TargetFeatures, TrainBatch

    ids = target.tokenizer("def add(a, b):\n    return a + b\n\nprint(add(2, 3))", return_tensors="pt").input_ids
    with torch.no_grad():
        hs = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    lm_head = target.model.get_output_embeddings()
    scaled = torch.nn.Linear(lm_head.in_features, lm_head.out_features, bias=False)
    with torch.no_grad():
        scaled.weight.copy_(lm_head.weight / 0.5)
    mask = torch.ones_like(ids)
    batch = TrainBatch(ids, mask, torch.cat([mask[:, :4] * 0, mask[:, 4:]], 1))
    losses = {}
    for name, temp, head_ in (("t05", 0.5, lm_head), ("scaled", 1.0, scaled), ("t1", 1.0, lm_head)):
        spec, cfg, head = _head(
            target, draft_vocab_size=512, ttt_steps=2, teacher_temperature=temp, loss_all_positions=loss_all_positions
        )
        spec.prepare(head, [Row(ids[0].tolist(), [0] * 4 + [1] * (ids.shape[1] - 4))], cfg, target.model)
        feats = TargetFeatures({i: hs[i] for i in (2, 15, 27, 30)}, 30, head_)
        with torch.no_grad():
            losses[name] = float(spec.loss(head, batch, feats, cfg)[0])
    assert losses["t05"] == pytest.approx(losses["scaled"], rel=1e-5)
    assert abs(losses["t05"] - losses["t1"]) > 1e-3
    with pytest.raises(ConfigError, match="teacher_temperature"):
        spec.build(spec.config_cls(teacher_temperature=0.0), target.model)


def test_loss_all_positions_also_trains_where_the_target_top_is_outside_the_draft_vocabulary(target) -> None:
    """drafter.loss_all_positions: positions whose target top token the draft vocabulary cannot hold count too
    (against the target's distribution renormalised over the draft vocabulary); off, only the others count."""
    from train.batches import Row
    from train.drafters.registry import TargetFeatures, TrainBatch

    text = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"
    ids = target.tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        hs = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    feats = TargetFeatures({i: hs[i] for i in (2, 15, 27, 30)}, 30, target.model.get_output_embeddings())
    mask = torch.ones_like(ids)
    batch = TrainBatch(ids, mask, torch.cat([mask[:, :4] * 0, mask[:, 4:]], 1))
    counted = {}
    for every in (False, True):
        # a vocabulary of 8 of the row's tokens: the target's top token is often outside it
        spec, cfg, head = _head(target, draft_vocab_size=8, ttt_steps=1, loss_all_positions=every)
        spec.prepare(head, [Row(ids[0].tolist(), [0] * 4 + [1] * (ids.shape[1] - 4))], cfg, target.model)
        loss, metrics = spec.loss(head, batch, feats, cfg)
        assert torch.isfinite(loss)
        counted[every] = int(metrics["tokens"])
        coverage = float(metrics["vocab_coverage"])
    need = int(batch.loss_mask[:, 2:].sum())
    assert coverage < 1.0 and counted[True] == need > counted[False] > 0, (counted, need, coverage)


@pytest.mark.parametrize(("loss_all_positions", "window"), [(False, None), (True, None), (True, 5)])
def test_unrolling_only_the_needed_entries_equals_the_full_unroll(
    target, loss_all_positions: bool, window: int | None
) -> None:
    """Training unrolls TTT steps only for entries whose chain reaches a target-written token; prompt positions
    give step 0's keys/values only. Loss, every metric and every gradient must equal the full unroll's, on two
    real rows of different prompt lengths with right padding (so the selected entries differ per row), and the
    draft-vocabulary-only teacher projection (``loss_all_positions``) must equal slicing the full one; with a
    sliding window too (the selected queries' positions limit their keys)."""
    from train.batches import Row
    from train.drafters.eagle3 import loss_fn
    from train.drafters.layers import lm_head_rows
    from train.drafters.registry import TargetFeatures, TrainBatch

    texts = [
        "Write a function that adds two numbers.\ndef add(a, b):\n    return a + b\n\nprint(add(2, 3))",
        "Tell me a short fact about the moon, in one sentence please. The moon has no air.",
    ]
    enc = [target.tokenizer(t).input_ids for t in texts]
    prompt = [len(enc[0]) - 14, 6]  # different prompt lengths: entries selected per row differ
    L = max(map(len, enc))
    ids = torch.zeros(2, L, dtype=torch.long)
    am = torch.zeros(2, L, dtype=torch.long)
    lm = torch.zeros(2, L, dtype=torch.long)
    for b, e in enumerate(enc):
        ids[b, : len(e)] = torch.tensor(e)
        am[b, : len(e)] = 1
        lm[b, prompt[b] : len(e)] = 1
    with torch.no_grad():
        hs = target.model(input_ids=ids, attention_mask=am, output_hidden_states=True).hidden_states
    feats = TargetFeatures({i: hs[i] for i in (2, 15, 27, 30)}, 30, target.model.get_output_embeddings())
    batch = TrainBatch(ids, am, lm)
    spec, cfg, head = _head(
        target, draft_vocab_size=64, ttt_steps=3, loss_all_positions=loss_all_positions, sliding_window=window
    )
    spec.prepare(head, [Row(e, m[: len(e)].tolist()) for e, m in zip(enc, lm, strict=True)], cfg, target.model)
    head.train()
    runs = {}
    for needed_only in (False, True):
        head.zero_grad()
        loss, metrics = loss_fn(head, batch, feats, cfg, needed_only=needed_only)
        loss.backward()
        grads = {k: p.grad.clone() for k, p in head.named_parameters() if p.grad is not None}
        runs[needed_only] = (loss.detach(), {k: float(v) for k, v in metrics.items()}, grads)
    (l0, m0, g0), (l1, m1, g1) = runs[False], runs[True]
    assert m0["tokens"] > 0 and m0.keys() == m1.keys() and g0.keys() == g1.keys() and "fc.weight" in g0
    assert torch.allclose(l0, l1, rtol=1e-5), (l0, l1)
    for k in m0:
        assert m0[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
    for k in g0:
        assert torch.allclose(g0[k], g1[k], rtol=1e-4, atol=1e-6 * float(g0[k].abs().max())), k
    # and leaving a needed entry out changes the loss (the comparison can fail)
    cut = TrainBatch(ids, am, torch.cat([lm[:, :-3], lm[:, -3:] * 0], 1))
    assert not torch.allclose(loss_fn(head, cut, feats, cfg)[0], l1, rtol=1e-5)
    x = hs[30][0, :5]
    lm_head = target.model.get_output_embeddings()
    assert torch.allclose(lm_head_rows(lm_head, x, head.target_ids()), lm_head(x)[:, head.target_ids()], atol=1e-4)


def _question_row(target):  # -> (ids [1, L], TrainBatch with an 8-token prompt, TargetFeatures of layers 2/15/27/30)
    from train.drafters.registry import TargetFeatures, TrainBatch

    ids = target.tokenizer("Question: what is two plus three? Answer: two plus three is five.", return_tensors="pt")
    ids = ids.input_ids
    with torch.no_grad():
        hs = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    feats = TargetFeatures({i: hs[i] for i in (2, 15, 27, 30)}, 30, target.model.get_output_embeddings())
    am = torch.ones_like(ids)
    return ids, TrainBatch(ids, am, torch.cat([am[:, :8] * 0, am[:, 8:]], 1)), feats


def test_loss_on_prompt_also_trains_at_prompt_positions(target) -> None:
    """drafter.loss_on_prompt: every real position counts (the target's distribution after each prompt token),
    not only target-written ones; the unroll then covers every entry and still equals the full unroll."""
    from train.batches import Row
    from train.drafters.eagle3 import loss_fn

    ids, batch, feats = _question_row(target)
    lm = batch.loss_mask
    counted = {}
    for on_prompt in (False, True):
        spec, cfg, head = _head(target, draft_vocab_size=256, ttt_steps=2, loss_on_prompt=on_prompt)
        spec.prepare(head, [Row(ids[0].tolist(), lm[0].tolist())], cfg, target.model)
        loss, metrics = loss_fn(head, batch, feats, cfg)
        full, _ = loss_fn(head, batch, feats, cfg, needed_only=False)
        assert torch.allclose(loss, full, rtol=1e-5)
        counted[on_prompt] = int(metrics["tokens"])
    assert counted[False] == int(lm[:, 2:].sum()) and counted[True] == ids.shape[1] - 2


def test_feature_noise_and_token_alignment_change_only_what_they_claim(target) -> None:
    """drafter.feature_noise noises the target features in training only (eval: the noise-free loss);
    drafter.ttt_align_topk drops later TTT steps' entries whose fed tokens fell outside the draft's top-k: with
    every position counted and k as large as the draft vocabulary (every fed token is in it) nothing is dropped,
    with k=1 on an untrained head most are, and the loss changes."""
    from train.batches import Row
    from train.drafters.eagle3 import loss_fn

    ids, batch, feats = _question_row(target)
    row = [Row(ids[0].tolist(), batch.loss_mask[0].tolist())]

    def loss(train: bool, **kw) -> float:
        spec, cfg, head = _head(target, draft_vocab_size=256, ttt_steps=3, **kw)
        spec.prepare(head, row, cfg, target.model)
        head.train(train)
        torch.manual_seed(1)
        return float(loss_fn(head, batch, feats, cfg)[0].detach())

    plain = loss(True)
    assert loss(False, feature_noise=0.2) == plain
    assert abs(loss(True, feature_noise=0.2) - plain) > 1e-4
    # every position counted at every step (loss_on_prompt): only the top-k rule can drop an entry
    every = loss(True, loss_on_prompt=True)
    assert loss(True, loss_on_prompt=True, ttt_align_topk=256) == pytest.approx(every, rel=1e-6)
    assert abs(loss(True, loss_on_prompt=True, ttt_align_topk=1) - every) > 1e-3


@pytest.mark.parametrize("norm_output", [False, True])
def test_feature_loss_regresses_what_the_lm_head_reads_onto_the_targets_last_state(target, norm_output: bool) -> None:
    """drafter.feature_loss=w adds w * decay^j * SmoothL1 at every TTT step; step 1's term equals a direct
    computation (the vector the draft LM head reads at each counted entry against the target's last hidden state one
    position on, the state the target's LM head reads to predict the same token); w < 0 is refused."""
    from data.config import ConfigError
    from train.batches import Row
    from train.drafters.eagle3 import loss_fn, ttt_mask

    ids, batch, feats = _question_row(target)
    row = [Row(ids[0].tolist(), batch.loss_mask[0].tolist())]
    out = {}
    for w in (0.0, 0.7):
        spec, cfg, head = _head(target, draft_vocab_size=256, ttt_steps=3, feature_loss=w, norm_output=norm_output)
        spec.prepare(head, row, cfg, target.model)
        with torch.no_grad():
            out[w] = loss_fn(head, batch, feats, cfg)
    (plain, m0), (with_reg, m1) = out[0.0], out[0.7]
    regs = [float(m1[f"feature_loss_step{j + 1}"]) for j in range(3)]
    assert "feature_loss_step1" not in m0 and all(r > 0 for r in regs)
    assert float(with_reg) == pytest.approx(float(plain) + 0.7 * sum(0.8**j * r for j, r in enumerate(regs)), rel=1e-5)
    for j in range(3):  # the distillation part is unchanged
        assert float(m1[f"loss_step{j + 1}"]) == pytest.approx(float(m0[f"loss_step{j + 1}"]), rel=1e-6)
    # step 1 by hand: the full (unselected) first step on the fused layers
    T = ids.shape[1] - 1
    fused = torch.cat([feats.layers[i][:, :T] for i in (2, 15, 27)], -1)
    with torch.no_grad():
        h, _ = head(fused, ids[:, 1 : 1 + T], torch.arange(T)[None], mask=ttt_mask(T, 0, ids.device)[None, None])
        read = h if norm_output else head.norm(h)
    counted = batch.loss_mask[:, 2:].bool()  # entry t < T - 1 predicts x[t+2]
    last = feats.last[:, 1:T]
    direct = torch.nn.functional.smooth_l1_loss(read[:, : T - 1][counted], last[counted], reduction="none")
    direct = direct.mean(-1).mean()
    assert regs[0] == pytest.approx(float(direct), rel=1e-4)
    with pytest.raises(ConfigError, match="feature_loss"):
        spec.build(spec.config_cls(feature_loss=-1.0), target.model)


def test_acceptance_losses_measure_the_overlap_that_sampling_accepts() -> None:
    """drafter.loss=tv / lk / lk_hybrid: 1 - sum min(p, q), -log of it, and the KL/TV blend, on distributions whose
    overlap is known; all zero (and TV's and LK's gradients zero) when q equals p; a step on TV raises the overlap;
    an unknown kind is refused."""
    from train.drafters.layers import acceptance_loss

    p = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    q_logits = torch.log(torch.tensor([[0.2, 0.2, 0.2, 0.4]]))  # overlap min: 0.2 + 0.2 + 0.2 + 0 = 0.6
    tv, top = acceptance_loss(q_logits, p, "tv")
    assert float(tv) == pytest.approx(0.4, abs=1e-6) and int(top) == 3
    assert float(acceptance_loss(q_logits, p, "lk")[0]) == pytest.approx(-torch.log(torch.tensor(0.6)).item(), 1e-5)
    kl = float((p[p > 0] * (p[p > 0].log() - q_logits[p > 0])).sum())
    w = float(torch.exp(torch.tensor(-3.0 * 0.6)))
    assert float(acceptance_loss(q_logits, p, "lk_hybrid")[0]) == pytest.approx(w * kl + (1 - w) * 0.4, rel=1e-5)
    # at temperature 2 the draft is flattened before the overlap is taken
    flat = torch.softmax(q_logits / 2, -1)
    assert float(acceptance_loss(q_logits, p, "tv", temperature=2.0)[0]) == pytest.approx(
        1 - float(torch.minimum(flat, p).sum()), abs=1e-6
    )
    same = torch.log(torch.tensor([[0.5, 0.3, 0.2, 1e-9]])).requires_grad_()
    for kind in ("tv", "lk", "lk_hybrid"):
        loss, _ = acceptance_loss(same, p, kind)
        assert float(loss) == pytest.approx(0.0, abs=1e-5), kind
    x = q_logits.clone().requires_grad_()
    acceptance_loss(x, p, "tv")[0].backward()
    stepped = x.detach() - 1.0 * x.grad
    assert float(acceptance_loss(stepped, p, "tv")[0]) < 0.4
    with pytest.raises(ValueError, match="unknown acceptance loss"):
        acceptance_loss(q_logits, p, "js")


@pytest.mark.parametrize("loss", ["tv", "lk", "lk_hybrid"])
def test_eagle3_trains_on_an_acceptance_loss(target, loss: str) -> None:
    """The head's TTT loss with drafter.loss=<kind>: a different value from the KL loss on the same batch, and a few
    Adam steps on it raise the draft's overlap with the target's distribution at every TTT step."""
    from train.batches import Row
    from train.drafters.registry import TargetFeatures, TrainBatch

    ids = target.tokenizer("def add(a, b):\n    return a + b\n\nprint(add(2, 3))", return_tensors="pt").input_ids
    with torch.no_grad():
        hs = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    mask = torch.ones_like(ids)
    batch = TrainBatch(ids, mask, torch.cat([mask[:, :4] * 0, mask[:, 4:]], 1))
    feats = TargetFeatures({i: hs[i] for i in (2, 15, 27, 30)}, 30, target.model.get_output_embeddings())
    row = [Row(ids[0].tolist(), [0] * 4 + [1] * (ids.shape[1] - 4))]
    spec, kl_cfg, kl_head = _head(target, draft_vocab_size=512, ttt_steps=2)
    spec.prepare(kl_head, row, kl_cfg, target.model)
    spec, cfg, head = _head(target, draft_vocab_size=512, ttt_steps=2, loss=loss)
    spec.prepare(head, row, cfg, target.model)
    with torch.no_grad():
        assert (
            abs(float(spec.loss(head, batch, feats, cfg)[0]) - float(spec.loss(kl_head, batch, feats, kl_cfg)[0]))
            > 1e-3
        )

    def tv_now() -> float:
        tv_cfg = spec.config_cls(**{**cfg.__dict__, "loss": "tv"})
        with torch.no_grad():
            return float(spec.loss(head.eval(), batch, feats, tv_cfg)[0])

    before = tv_now()
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-3)
    head.train()
    for _ in range(8):
        loss_value, _ = spec.loss(head, batch, feats, cfg)
        opt.zero_grad()
        loss_value.backward()
        opt.step()
    assert tv_now() < before - 0.05  # the summed TV over both TTT steps fell: the overlap grew
