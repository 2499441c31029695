"""DFlash on the real target: the training forward is the drafting forward, the loss is the target's distribution at
the right positions with the position decay, the proposer is lossless (chain and tree), training falls and resumes
exactly, and the exports carry what the engines read."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import SMALL_SYNTH
from tests.test_train.runs import assert_greedy_identity, assert_kill_resume_exact
from tests.test_train.runs import losses as _losses
from tests.test_train.runs import ok as _ok
from tests.test_train.runs import run_train as _run
from tests.test_train.test_eagle_train import TRAIN

pytestmark = pytest.mark.slow


def _draft(target, **kw):  # -> (spec, cfg, head)
    from train.drafters import registry

    spec = registry.get("dflash")
    cfg = spec.config_cls(**kw)
    torch.manual_seed(0)
    head = spec.build(cfg, target.model).float().eval()
    with torch.no_grad():  # a draft that is not the identity of its init: every path carries signal
        for p in head.parameters():
            if p.requires_grad and p.dim() > 1:
                p.normal_(0, 0.05)
    return spec, cfg, head


def _batch(target, n: int = 2, length: int = 40):  # -> (TrainBatch, TargetFeatures)
    from data.target import output_head
    from train.drafters.registry import TargetFeatures, TrainBatch

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(20, 5000, (n, length), generator=g)
    am = torch.ones_like(ids)
    am[1, length - 7 :] = 0  # a shorter second row (right padding)
    lm = torch.zeros_like(ids)
    lm[:, 12:] = 1  # a prompt of 12 tokens, then target-written ones
    lm[1, 20] = 0  # a token in the answer that is not target-written
    lm = lm * am
    with torch.no_grad():
        hs = target.model(input_ids=ids, attention_mask=am, output_hidden_states=True).hidden_states
    n_layers = target.model.config.num_hidden_layers
    return TrainBatch(ids, am, lm), TargetFeatures(dict(enumerate(hs)), n_layers, output_head(target.model))


def test_the_training_forward_drafts_what_the_proposer_drafts(target) -> None:
    """Every anchor's block in the batched, masked training forward gives the logits that drafting after the same
    prefix gives (its own cached context, no mask): the masks, positions and context rows are the inference ones."""
    from train.drafters.dflash import block_mask, choose_anchors

    _, _, head = _draft(target, block_size=5, num_layers=2, draft_vocab_size=0)
    batch, feats = _batch(target)
    rows = head.fuse(torch.cat([feats.layers[i] for i in head.layer_ids], -1))
    B, L = batch.input_ids.shape
    can = batch.loss_mask.bool()
    can[:, 0] = False
    torch.manual_seed(1)
    anchors, valid = choose_anchors(can, 6)
    assert valid.all() and bool((anchors[:, 1:] > anchors[:, :-1]).all())  # distinct, in position order
    assert bool(can.gather(1, anchors).all())
    bs = head.block_size
    block = head.block_ids(batch.input_ids.gather(1, anchors).reshape(-1)).view(B, -1)
    pos = (anchors[:, :, None] + torch.arange(bs)).view(B, -1)
    ctx = head.context_kv(rows, torch.arange(L).expand(B, L))
    with torch.no_grad():
        h = head.hidden(block, pos, ctx, block_mask(anchors, batch.attention_mask, bs)).view(
            B, anchors.shape[1], bs, -1
        )
        for b in range(B):
            for j, a in enumerate(anchors[b].tolist()):
                c = head.context_kv(rows[b : b + 1, :a], torch.arange(a)[None])
                ref = head.block_logits(batch.input_ids[b, a : a + 1], torch.tensor([a]), c)[0]
                assert torch.allclose(head.full_logits(h[b, j, 1:]), ref, atol=1e-4), (b, a)


def test_the_loss_is_the_targets_distribution_at_each_slot_with_the_decay(target) -> None:
    """The loss recomputed by hand from drafting after each anchor: slot k is compared with the target's distribution
    at a + k - 1 (the one that verifies x[a + k]) where x[a + k] is target-written, weighted exp(-(k - 1) / gamma);
    an off-by-one in the teacher, the mask or the weights changes it."""
    from train.drafters.dflash import choose_anchors, loss_fn

    _, cfg, head = _draft(target, block_size=4, anchors_per_row=5, draft_vocab_size=0, loss_gamma=2.0)
    batch, feats = _batch(target)
    torch.manual_seed(7)
    with torch.no_grad():
        loss, metrics = loss_fn(head, batch, feats, cfg)
    # the same anchors: choose_anchors is the loss's first draw from the global generator
    written = batch.loss_mask.bool() & batch.attention_mask.bool()
    L = written.shape[1]
    padded = torch.cat([written, torch.zeros(2, 4, dtype=torch.bool)], 1)
    can = written & torch.stack([padded[:, k : k + L] for k in (1, 2, 3)], -1).any(-1)
    can[:, 0] = False
    torch.manual_seed(7)
    anchors, valid = choose_anchors(can, 5)
    rows = head.fuse(torch.cat([feats.layers[i] for i in head.layer_ids], -1))
    total, count = 0.0, 0
    for b in range(2):
        for a in anchors[b][valid[b]].tolist():
            c = head.context_kv(rows[b : b + 1, :a], torch.arange(a)[None])
            with torch.no_grad():
                logits = head.block_logits(batch.input_ids[b, a : a + 1], torch.tensor([a]), c)[0]
            for k in range(1, 4):
                if a + k >= L or not written[b, a + k]:
                    continue
                teacher = torch.softmax(feats.lm_head(feats.last[b, a + k - 1]).float(), -1)
                ce = -(teacher * torch.log_softmax(logits[k - 1], -1)).sum()
                total += math.exp(-(k - 1) / 2.0) * float(ce)
                count += 1
    assert count > 10
    assert float(loss) == pytest.approx(total / count, rel=1e-4)
    assert float(metrics["tokens"]) == sum(
        1 for b in range(2) for a in anchors[b][valid[b]].tolist() if a + 1 < L and written[b, a + 1]
    )


@pytest.mark.parametrize("decode", ["chain", "tree"])
def test_dflash_proposer_is_lossless_on_the_real_target(target, decode: str) -> None:
    from train.batches import Row

    spec, cfg, head = _draft(
        target,
        decode=decode,
        block_size=6,
        chain_k=5,
        tree_depth=4,
        tree_top_k=3,
        tree_total_tokens=10,
        draft_vocab_size=4096,
    )
    spec.prepare(head, [Row(list(range(0, 8192, 2)), [1] * 4096)], cfg, target.model)  # misses half the ids
    assert head.mask_token_id == 1  # the smallest id the rows never hold
    assert_greedy_identity(
        target,
        lambda: spec.proposer(head, target.model, cfg),
        ("Write a Python function that reverses a string.", "Name three colours."),
    )


def test_the_mask_token_is_chosen_from_the_data_or_given(target) -> None:
    from data.config import ConfigError
    from train.batches import Row

    spec, cfg, head = _draft(target, draft_vocab_size=64)
    info = spec.prepare(head, [Row([0, 1, 2, 4, 5], [0, 0, 1, 1, 1])], cfg, target.model)
    assert info["mask_token_id"] == head.mask_token_id == 3
    spec, cfg, head = _draft(target, draft_vocab_size=64, mask_token_id=17)
    assert spec.prepare(head, [Row([0, 1, 2], [0, 1, 1])], cfg, target.model)["mask_token_id"] == 17
    with pytest.raises(ConfigError, match="mask_token_id"):
        _draft(target, mask_token_id=10**7)


def _train_args(synth_dir: Path) -> list[str]:
    return [
        *SMALL_SYNTH,
        "stage=train",
        f"synth_dir={synth_dir}",
        *TRAIN,
        "drafter=dflash",
        "drafter.draft_vocab_size=1024",
        "drafter.block_size=4",
        "drafter.anchors_per_row=8",
        "deepspeed=none",
        "train.lr=3e-3",
    ]


def test_dflash_trains_and_resumes_exactly(synth_dir: Path, tmp_path: Path, run_env: dict[str, str]) -> None:
    base = _train_args(synth_dir)
    one = tmp_path / "one"
    _ok(_run([*base, f"hydra.run.dir={one}"], run_env))
    losses = _losses(one)
    assert len(losses) == 6 and sum(losses[-2:]) < 0.9 * sum(losses[:2]), losses
    manifest = json.loads((one / "manifest.json").read_text())
    data = manifest["result"]["drafter_data"]
    assert data["draft_vocab_size"] == 1024 and isinstance(data["mask_token_id"], int)
    best = one / "best"
    cfg_json = json.loads((best / "config.json").read_text())
    assert cfg_json["block_size"] == 4 and cfg_json["mask_token_id"] == data["mask_token_id"]
    assert "embed_tokens.weight" not in load_file(str(best / "model.safetensors"))

    assert_kill_resume_exact(base, one, tmp_path / "killed", run_env, last_step=6)


def test_the_exports_carry_what_the_engines_read(target, tmp_path: Path) -> None:
    """speculators: non-causal block (vLLM reads sliding_window_non_causal), HF layer ids, the draft's LM head and
    vocabulary maps, K = block_size - 1; native (SGLang): the engines' 0-based layer ids, no LM head, and only for a
    draft whose LM head is the target's."""
    from train.batches import Row
    from train.export import export_drafter
    from train.export.core import ExportError, Source, get_format

    rows = [Row(list(range(100, 400)), [0] * 50 + [1] * 250)]
    for kw, native_ok in (({"draft_vocab_size": 256}, False), ({"draft_vocab_size": 0, "freeze_lm_head": True}, True)):
        spec, cfg, head = _draft(target, **kw)
        spec.prepare(head, rows, cfg, target.model)
        saved = tmp_path / f"d{cfg.draft_vocab_size}"
        spec.save(head, str(saved), cfg, target)
        src = Source(saved, "dflash", spec.load(str(saved), target.model, cfg), cfg, target, "smollm2")
        res = export_drafter(src, get_format("dflash", "speculators"), saved / "spec")
        assert res["round_trip_max_abs_logit_diff"] <= 1e-5
        conf = json.loads((saved / "spec" / "config.json").read_text())
        assert conf["speculators_model_type"] == "dflash" and conf["sliding_window_non_causal"] is True
        assert conf["aux_hidden_state_layer_ids"] == [2, 15, 27] and conf["mask_token_id"] == head.mask_token_id
        assert conf["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == cfg.block_size - 1
        assert conf["transformer_layer_config"]["model_type"] == "qwen3"
        weights = load_file(str(saved / "spec" / "model.safetensors"))
        assert ("d2t" in weights) == (cfg.draft_vocab_size != 0) and "lm_head.weight" in weights
        assert not [k for k in weights if k.startswith(("embed_tokens", "mask_token", "rotary"))]
        if not native_ok:
            with pytest.raises(ExportError, match="freeze_lm_head=true"):
                export_drafter(src, get_format("dflash", "sglang_dflash"), saved / "native")
            assert not (saved / "native").exists()
            continue
        export_drafter(src, get_format("dflash", "sglang_dflash"), saved / "native")
        conf = json.loads((saved / "native" / "config.json").read_text())
        assert conf["architectures"] == ["DFlashDraftModel"] and conf["model_type"] == "qwen3"
        assert conf["dflash_config"] == {"mask_token_id": head.mask_token_id, "target_layer_ids": [1, 14, 26]}
        assert conf["block_size"] == cfg.block_size and conf["num_target_layers"] == 30
        weights = load_file(str(saved / "native" / "model.safetensors"))
        assert not [k for k in weights if k.startswith(("lm_head", "d2t", "t2d", "embed_tokens"))]
        assert weights["layers.0.self_attn.k_norm.weight"].shape == (head.layers[0].self_attn.head_dim,)
