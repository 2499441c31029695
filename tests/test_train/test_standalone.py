"""The standalone draft-model family on the real target: training (loss falls, kill-and-resume is exact),
lossless decoding (chain and tree), init=target copies, the distillation loss, tokenizer/vocab refusals,
and a save -> load round trip through a plain HF directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import SMALL_SYNTH
from tests.derived import assert_best_is_best_check
from tests.test_train.runs import assert_greedy_identity, assert_kill_resume_exact
from tests.test_train.runs import losses as _losses
from tests.test_train.runs import ok as _ok
from tests.test_train.runs import run_train as _run

pytestmark = pytest.mark.slow

TRAIN = [
    "drafter=standalone",
    "drafter.num_layers=2",
    "train.features=online",
    "train.max_steps=4",
    "train.micro_batch_size=2",
    "train.grad_accum=1",
    "train.lr=3e-4",
    "train.warmup_steps=1",
    "train.save_every=2",
    "train.eval_every=0",
    "train.eval_prompts=1",
    "train.eval_max_new_tokens=8",
    "train.log_every=1",
    "wandb.mode=disabled",
]


def _spec_cfg(**kw: Any) -> tuple[Any, Any]:
    from train.drafters import registry

    spec = registry.get("standalone")
    return spec, spec.config_cls(**kw)


def _batch(target: Any) -> tuple[Any, Any]:
    """A two-row batch (one right-padded) with the target's features, as the training loop gives them."""
    from train.drafters.registry import TargetFeatures, TrainBatch

    tok = target.tokenizer
    a = tok.encode("The capital of France is Paris. The capital of Italy is Rome.")
    b = tok.encode("Count: one, two, three, four")
    L = max(len(a), len(b))
    ids = torch.full((2, L), tok.pad_token_id, dtype=torch.long)
    am = torch.zeros(2, L, dtype=torch.long)
    for i, row in enumerate((a, b)):
        ids[i, : len(row)] = torch.tensor(row)
        am[i, : len(row)] = 1
    lm = am.clone()
    lm[:, :3] = 0  # the "prompt" is not target-written
    with torch.no_grad():
        out = target.model(input_ids=ids, attention_mask=am, output_hidden_states=True)
    n = target.model.config.num_hidden_layers
    feats = TargetFeatures(layers={n: out.hidden_states[n]}, num_layers=n, lm_head=target.model.get_output_embeddings())
    return TrainBatch(ids, am, lm), feats


def _perturbed_draft(target: Any, **kw: Any) -> tuple[Any, Any, Any]:
    spec, cfg = _spec_cfg(num_layers=2, gradient_checkpointing=False, **kw)
    spec.check(cfg, target)
    torch.manual_seed(0)
    draft = spec.build(cfg, target.model).eval()
    with torch.no_grad():  # arbitrary drafts: decoding must stay lossless anyway
        for layer in draft.model.layers:
            layer.self_attn.o_proj.weight.add_(torch.randn_like(layer.self_attn.o_proj.weight) * 0.05)
    return spec, cfg, draft


def test_loss_falls_and_resume_is_exact(synth_dir: Path, tmp_path: Path, run_env: dict[str, str]) -> None:
    from transformers import AutoModelForCausalLM

    base = [*SMALL_SYNTH, "stage=train", f"synth_dir={synth_dir}", *TRAIN]
    one = tmp_path / "one"
    out = _ok(_run([*base, f"hydra.run.dir={one}"], run_env))
    losses = _losses(one)
    assert len(losses) == 4
    assert sum(losses[-2:]) < 0.85 * sum(losses[:2]), losses  # it learns
    manifest = json.loads((one / "manifest.json").read_text())
    assert manifest["result"]["finished"]
    assert_best_is_best_check(manifest)
    best = one / "best"
    assert (best / "model.safetensors").is_file() and (best / "tokenizer.json").is_file()
    meta = json.loads((best / "config.json").read_text())
    assert meta["draftsmith"]["drafter"]["name"] == "standalone" and meta["num_hidden_layers"] == 2
    assert AutoModelForCausalLM.from_pretrained(best).config.num_hidden_layers == 2  # a plain HF directory
    assert "trainable parameters" in out

    # Kill with SIGKILL once the step-2 checkpoint is complete, then resume=true: same losses and weights.
    assert_kill_resume_exact(base, one, tmp_path / "killed", run_env, last_step=4)


@pytest.mark.parametrize("decode", ["chain", "tree"])
def test_standalone_proposer_is_lossless_on_the_real_target(target, decode: str) -> None:

    spec, cfg, draft = _perturbed_draft(
        target, decode=decode, chain_k=4, tree_depth=4, tree_top_k=3, tree_total_tokens=10
    )
    assert_greedy_identity(
        target, lambda: spec.proposer(draft, target.model, cfg), ("Write a Python function that reverses a string.",)
    )


def test_init_target_copies_layers_and_loss(target) -> None:
    from data.config import ConfigError
    from train.drafters.standalone import default_layer_ids, distill_terms

    assert default_layer_ids(4, 30) == [0, 10, 19, 29] and default_layer_ids(2, 30) == [0, 29]
    spec, cfg = _spec_cfg(num_layers=2, layer_ids=[3, 17])
    draft = spec.build(cfg, target.model)
    t = target.model.state_dict()
    d = draft.state_dict()
    for i, j in enumerate([3, 17]):
        for k in (
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "mlp.down_proj.weight",
            "input_layernorm.weight",
        ):
            assert torch.equal(d[f"model.layers.{i}.{k}"], t[f"model.layers.{j}.{k}"]), (i, k)
    assert torch.equal(d["model.norm.weight"], t["model.norm.weight"])
    assert draft.get_output_embeddings().weight is draft.get_input_embeddings().weight  # tied, like the target
    assert torch.equal(draft.get_input_embeddings().weight, target.model.get_input_embeddings().weight)
    assert not draft.get_input_embeddings().weight.requires_grad  # freeze_embeddings
    assert draft.model.layers[0].mlp.up_proj.weight.requires_grad
    assert draft.config._attn_implementation == "sdpa"

    with pytest.raises(ConfigError, match="shapes must be the target's"):
        spec.build(spec.config_cls(hidden_size=256), target.model)
    with pytest.raises(ConfigError, match="layer_ids"):
        spec.build(spec.config_cls(num_layers=2, layer_ids=[0, 30]), target.model)
    with pytest.raises(ConfigError, match=r"drafter\.loss"):
        spec.build(spec.config_cls(loss="ce"), target.model)

    # The loss terms: zero for identical distributions, TV in [0, 1].
    logits = torch.randn(5, 50)
    kl, tv = distill_terms(logits, logits)
    assert torch.allclose(kl, torch.zeros(5), atol=1e-6) and torch.allclose(tv, torch.zeros(5), atol=1e-6)
    kl, tv = distill_terms(logits, torch.randn(5, 50) * 3)
    assert (kl > 0).all() and ((tv > 0) & (tv <= 1)).all()

    # A draft that is the whole target (all 30 layers copied) has zero loss and 100% top-1 agreement,
    # counted on the target-written positions only.
    batch, feats = _batch(target)
    spec, full_cfg = _spec_cfg(num_layers=30, loss="kl_tv", gradient_checkpointing=False)
    full = spec.build(full_cfg, target.model).eval()
    with torch.no_grad():
        loss, m = spec.loss(full, batch, feats, full_cfg)
    expected = int((batch.loss_mask[:, 1:] * batch.attention_mask[:, 1:]).sum())
    assert float(m["tokens"]) == expected
    assert float(loss) < 1e-4 and float(m["kl"]) < 1e-4 and float(m["tv"]) < 1e-3
    assert float(m["acc_top1_pos1"]) == 1.0
    # drafter.loss_on_prompt: every position whose next token is real counts, prompt included, still exact.
    on_prompt = spec.config_cls(**{**vars(full_cfg), "loss_on_prompt": True})
    with torch.no_grad():
        loss, m = spec.loss(full, batch, feats, on_prompt)
    assert float(m["tokens"]) == int(batch.attention_mask[:, 1:].sum()) > expected
    assert float(loss) < 1e-4 and float(m["acc_top1_pos1"]) == 1.0
    del full

    # A 2-layer draft trains: the loss has gradients and (with gradient checkpointing) goes down.
    spec, small_cfg = _spec_cfg(num_layers=2, loss="kl_tv")
    small = spec.build(small_cfg, target.model).train()
    opt = torch.optim.AdamW([p for p in small.parameters() if p.requires_grad], lr=1e-4)
    first = None
    for _ in range(3):
        loss, m = spec.loss(small, batch, feats, small_cfg)
        first = float(loss.detach()) if first is None else first
        loss.backward()
        opt.step()
        opt.zero_grad()
    loss, _ = spec.loss(small, batch, feats, small_cfg)
    assert float(loss.detach()) < first


def _tiny_llama(vocab: int, out: Path) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    conf = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(conf)
    model.save_pretrained(out, safe_serialization=True)
    return model


def test_pretrained_draft_tokenizer_and_vocab_checks(target, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from data.config import ConfigError

    V = target.model.config.vocab_size
    same, other, bare = tmp_path / "same", tmp_path / "other", tmp_path / "bare"
    _tiny_llama(V, same)
    AutoTokenizer.from_pretrained(target.path).save_pretrained(same)
    _tiny_llama(V, other)
    tok = AutoTokenizer.from_pretrained(target.path)
    tok.add_tokens(["<draftsmith_new_token>"])
    tok.save_pretrained(other)
    _tiny_llama(V, bare)  # no tokenizer files

    spec, cfg = _spec_cfg(init="pretrained", pretrained_path=str(other))
    with pytest.raises(ConfigError, match="tokenizer is incompatible"):
        spec.check(cfg, target)
    spec, cfg = _spec_cfg(init="pretrained", pretrained_path=str(bare))
    with pytest.raises(ConfigError, match="no loadable tokenizer"):
        spec.check(cfg, target)
    spec, cfg = _spec_cfg(init="pretrained")
    with pytest.raises(ConfigError, match="pretrained_path"):
        spec.check(cfg, target)

    # The same tokenizer: accepted; the draft is the pretrained model (hidden 64), trainable and saved
    # with its tokenizer.
    spec, cfg = _spec_cfg(init="pretrained", pretrained_path=str(same), freeze_embeddings=False)
    spec.check(cfg, target)
    draft = spec.build(cfg, target.model)
    assert draft.config.hidden_size == 64 and draft.get_input_embeddings().weight.requires_grad
    spec.save(draft, str(tmp_path / "saved"), cfg, target)
    assert (tmp_path / "saved" / "tokenizer.json").is_file()

    # A vocabulary-size mismatch is refused at load (e.g. a drafter trained for another target).
    small = tmp_path / "small_vocab"
    _tiny_llama(1000, small)
    meta = json.loads((small / "config.json").read_text())
    meta["draftsmith"] = {"drafter": {"name": "standalone"}}
    (small / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="vocab_size=1000"):
        spec.load(str(small), target.model, cfg)
    with pytest.raises(ConfigError, match="vocab size"):
        spec.build(spec.config_cls(init="pretrained", pretrained_path=str(small)), target.model)


def test_save_load_round_trip(target, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train.drafters.registry import load_drafter

    spec, cfg, draft = _perturbed_draft(target, decode="chain", layer_ids=[5, 20])
    out = tmp_path / "drafter"
    spec.save(draft, str(out), cfg, target)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    ids = torch.tensor([target.tokenizer.encode("Speculative decoding drafts tokens and the target checks them.")])
    with torch.no_grad():
        ref = draft(input_ids=ids).logits
        loaded_spec, loaded, dcfg = load_drafter(str(out), target)
        assert loaded_spec.name == "standalone" and dcfg == cfg
        assert torch.equal(loaded(input_ids=ids).logits, ref)
        plain = AutoModelForCausalLM.from_pretrained(out)
        assert torch.allclose(plain(input_ids=ids).logits, ref, atol=1e-5)
    assert AutoTokenizer.from_pretrained(out).get_vocab() == target.tokenizer.get_vocab()
    # The eval stage refuses a saved draft whose tokenizer is not the target's.
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_tokens(["<not_the_targets_token>"])
    tok.save_pretrained(out)
    with pytest.raises(ValueError, match="incompatible with the target tokenizer"):
        load_drafter(str(out), target)
