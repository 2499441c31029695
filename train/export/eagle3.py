"""EAGLE-3 heads in the speculators / vLLM format (``speculators``) and for SGLang (``sglang_eagle3``).

Both hold the same weights as :class:`train.drafters.eagle3.Eagle3Head`; only names and config differ
(each layout as the engine's own loader reads it: speculators' ``Eagle3DraftModel`` and SGLang's
``LlamaForCausalLMEagle3``).

``speculators`` -- as ``speculators`` 0.9.0 itself writes an EAGLE-3 (checked against ``speculators train
--speculator-type eagle3 --dry-run --no-norm-before-residual --no-norm-before-fc --no-norm-output
--full-attention-indices 0 --d2t-path ... --t2d-path ...`` for the same target on this machine):

* ``model.safetensors``: ``embed_tokens.weight`` (the target's input embedding, frozen), ``fc.weight``
  [H, k*H], ``layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
  ``layers.0.self_attn.{q,k,v,o}_proj.weight`` (q/k/v take 2H inputs), ``layers.0.mlp.{gate,up,down}_proj.weight``,
  ``norm.weight``, ``lm_head.weight`` [draft_vocab, H], ``d2t`` (int64) and ``t2d`` (bool). Like speculators,
  ``d2t``/``t2d`` are left out when the draft vocabulary is the full vocabulary (vLLM then has no
  ``draft_id_to_target_id`` parameter and refuses a ``d2t``).
* ``config.json``: ``architectures: ["Eagle3DraftModel"]``, ``auto_map`` + ``config.py`` (speculators writes
  its config class's source; we write a one-line re-export of the same class), ``speculators_model_type``,
  ``speculators_version``, ``speculators_config`` (greedy proposal, verifier = the target directory),
  ``transformer_layer_config`` (the draft layer's LlamaConfig, full attention), ``draft_vocab_size``,
  ``eagle_aux_hidden_state_layer_ids`` (HF ``hidden_states`` indices = vLLM's aux layer ids: vLLM captures
  the residual stream entering decoder layer i, which is HF ``hidden_states[i]``) and the norm flags of our
  head's math, always written: ``fc_norm=false`` and the head's own ``norm_before_fc`` (an RMSNorm,
  ``input_norm.weight`` [k*H], on the fused features), ``norm_before_residual`` (the residual is the normed
  feature) and ``norm_output`` (the normed output is fed back), all false for EAGLE-3 as published
  (``drafter.norm_*``; speculators' trainer turns all three on).

``sglang_eagle3`` -- SpecForge's layout: our own checkpoint names (``midlayer.*``, ``fc``, ``norm``,
``lm_head``, ``d2t``, ``t2d``; no ``embed_tokens``) and a ``LlamaForCausalLMEagle3`` config. SGLang takes the
aux layers from the draft's ``eagle_config.eagle_aux_hidden_state_layer_ids`` as 0-based indices of the
decoder layer whose *output* is captured (it captures at ``id + 1``), i.e. HF index - 1; without them it
uses ``[2, N//2, N-3]`` as capture points (= HF indices). So the default layers are left implicit (both
engines then agree) and other layers are written in SGLang's convention.

SGLang's ``LlamaForCausalLMEagle3`` has none of the optional norms: ``sglang_eagle3`` refuses a head trained with
any of them. Both exporters refuse a head whose d2t/t2d are missing, inconsistent (:func:`check_vocab_maps`) or not the
ones it was trained with (``d2t_hash`` in the drafter's config.json).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from data.atomic import atomic_write_json
from train.drafters.eagle3 import Eagle3Config, Eagle3Head, norm_flags
from train.drafters.layers import draft_layer_config
from train.drafters.saving import load_state
from train.drafters.vocab import check_vocab_maps, default_layer_ids, vocab_hash
from train.export.core import (
    LLAMA_LAYER,
    SPECULATORS_VERSION,
    ExportError,
    Format,
    KeyMap,
    Shapes,
    ShapeTable,
    Source,
    clean_config,
    probe_ids,
    read_config,
    read_weights,
    register_format,
    shapes,
    speculators_config,
    target_dims,
    trained_d2t_hash,
)

WEIGHTS = "model.safetensors"
SPECULATORS_CONFIG_PY = '''"""Written by draftsmith: the class ``auto_map`` names (speculators writes its source)."""

from speculators.models.eagle3 import Eagle3SpeculatorConfig

__all__ = ["Eagle3SpeculatorConfig"]
'''
VOCAB_REQUIRED = ("fc.weight", "norm.weight", "lm_head.weight", "t2d", "d2t")
"""What SpecForge's exporter refuses to write without (``specforge/export/to_sglang.py``)."""
UNSUPPORTED_NORMS = {"fc_norm": False}
"""speculators/vLLM norm flags :class:`Eagle3Head` has no math for; other values are refused on import."""


# --------------------------------------------------------------------------------------------- the source


def _head(src: Source) -> Eagle3Head:
    if not isinstance(src.module, Eagle3Head):
        raise ExportError(f"{src.drafter_dir}: expected an EAGLE-3 head, got {type(src.module).__name__}")
    return src.module


def _layer_ids(src: Source) -> list[int]:
    ids = _head(src).layer_ids
    if len(ids) * _head(src).hidden_size != _head(src).fc.in_features:
        raise ExportError(f"{src.drafter_dir}: fc takes {_head(src).fc.in_features} inputs but layer_ids={ids}")
    return ids


def _full_vocab(src: Source) -> bool:
    return _head(src).draft_vocab_size == src.target_config.vocab_size


def check_vocab(src: Source, state: dict[str, torch.Tensor], where: str) -> None:
    """Refuse d2t/t2d that are missing, inconsistent with each other, or not the trained head's."""
    if "d2t" not in state or "t2d" not in state:
        missing = [k for k in ("d2t", "t2d") if k not in state]
        raise ExportError(f"refusing to write {where}: missing vocabulary map tensors {missing}")
    vd = int(state["lm_head.weight"].shape[0]) if "lm_head.weight" in state else _head(src).draft_vocab_size
    try:
        check_vocab_maps(state["d2t"].cpu(), state["t2d"].cpu(), vd, src.target_config.vocab_size)
    except ValueError as e:
        raise ExportError(f"refusing to write {where}: {e}") from e
    expected = trained_d2t_hash(src)
    if expected is None:
        raise ExportError(
            f"refusing to write {where}: {src.drafter_dir}/config.json records no d2t_hash, so the vocabulary "
            "map cannot be checked against the one the head was trained with"
        )
    got = vocab_hash(state["d2t"].cpu())
    if got != expected:
        raise ExportError(
            f"refusing to write {where}: d2t (hash {got}) is not the vocabulary map the head was trained with "
            f"(hash {expected}); a d2t rebuilt from other data collapses acceptance silently"
        )


SPEC_KEYS = KeyMap(rename=(("midlayer.", "layers.0."),), drop=("rotary.",))
"""speculators names the one draft layer ``layers.0.*`` and keeps the frozen embedding."""
SGL_KEYS = KeyMap(drop=("rotary.", "embed_tokens."))
"""SGLang (SpecForge) stores our own names, without the embedding (it takes the target's)."""

LAYER: ShapeTable = {**LLAMA_LAYER, "input_layernorm.weight": ("H",), "hidden_norm.weight": ("H",)}
HEAD: ShapeTable = {"fc.weight": ("H", "kH"), "norm.weight": ("H",), "lm_head.weight": ("vd", "H")}
INPUT_NORM: ShapeTable = {"input_norm.weight": ("kH",)}
VOCAB_MAPS: ShapeTable = {"d2t": ("vd",), "t2d": ("V",)}
EMBED: ShapeTable = {"embed_tokens.weight": ("V", "H")}
"""The head's tensors in the module's names (each format renames them through its :class:`KeyMap`)."""


def _required(src: Source, keys: KeyMap, vocab_maps: bool) -> dict[str, Shapes]:
    d = target_dims(src.target_config)
    dims = {**d, "A": 2 * d["H"], "kH": len(_layer_ids(src)) * d["H"], "vd": _head(src).draft_vocab_size}
    tables = [HEAD, EMBED]
    tables += [INPUT_NORM] if _head(src).norms["norm_before_fc"] else []
    tables += [VOCAB_MAPS] if vocab_maps else []
    req = {k: v for t in tables for k, v in shapes(t, dims).items()}
    req.update(shapes(LAYER, dims, "midlayer."))
    return {WEIGHTS: keys.to_file(req)}


def _drafter_meta(src: Source, fmt: str) -> dict[str, Any]:
    meta = src.provenance(fmt)
    meta["d2t_hash"] = vocab_hash(_head(src).d2t.cpu())
    meta["layer_ids"] = _layer_ids(src)
    return meta


# ---------------------------------------------------------------------------------------- speculators


def spec_required(src: Source) -> dict[str, Shapes]:
    return _required(src, SPEC_KEYS, vocab_maps=not _full_vocab(src))


def spec_tensors(src: Source) -> dict[str, dict[str, torch.Tensor]]:
    weights = SPECULATORS.mapped_tensors(src)
    if _full_vocab(src):  # as speculators: no d2t/t2d for the full vocabulary (vLLM refuses a d2t then)
        for k in ("d2t", "t2d"):
            weights[WEIGHTS].pop(k, None)
    return weights


def _window(src: Source) -> int | None:
    """The head's sliding window (``drafter.sliding_window``), None for full attention."""
    return _head(src).midlayer.self_attn.window


def _layer_config(tcfg: Any, window: int | None = None) -> dict[str, Any]:
    """``transformer_layer_config``: the keys speculators 0.9 writes for a Llama draft layer, from the draft layer
    config derived from the target's dimensions (any architecture). Full attention as speculators writes it
    (``layer_types: [full_attention]``, its default 2,048 in ``sliding_window``, unused), or with ``window`` a
    ``sliding_attention`` layer of that window: what speculators writes for its windowed layers and what vLLM's
    Llama layer reads (``layer_types`` + ``sliding_window``)."""
    tcfg = draft_layer_config(tcfg)
    conf = tcfg.to_dict()
    rope = conf.get("rope_parameters") or {"rope_theta": conf.get("rope_theta", 10000.0), "rope_type": "default"}
    return {
        "attention_bias": bool(conf.get("attention_bias", False)),
        "attention_dropout": conf.get("attention_dropout", 0.0),
        "bos_token_id": conf.get("bos_token_id"),
        "eos_token_id": conf.get("eos_token_id"),
        "head_dim": target_dims(tcfg)["q"] // tcfg.num_attention_heads,
        "hidden_act": conf.get("hidden_act", "silu"),
        "hidden_size": tcfg.hidden_size,
        "initializer_range": conf.get("initializer_range", 0.02),
        "intermediate_size": tcfg.intermediate_size,
        "layer_types": ["full_attention" if window is None else "sliding_attention"],
        "max_position_embeddings": conf.get("max_position_embeddings"),
        "mlp_bias": bool(conf.get("mlp_bias", False)),
        "model_type": "llama",
        "num_attention_heads": tcfg.num_attention_heads,
        "num_hidden_layers": 1,
        "num_key_value_heads": target_dims(tcfg)["kv"] // (target_dims(tcfg)["q"] // tcfg.num_attention_heads),
        "pad_token_id": None,
        "pretraining_tp": conf.get("pretraining_tp", 1),
        "rms_norm_eps": tcfg.rms_norm_eps,
        "rope_parameters": rope,
        "sliding_window": 2048 if window is None else int(window),
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": window is not None,
        "vocab_size": tcfg.vocab_size,
    }


def spec_config(src: Source) -> dict[str, Any]:
    import transformers

    tcfg = src.target_config
    head = _head(src)
    cfg = src.drafter_cfg if isinstance(src.drafter_cfg, Eagle3Config) else Eagle3Config()
    dtype = str(next(head.parameters()).dtype).replace("torch.", "")
    conf: dict[str, Any] = {
        "architectures": ["Eagle3DraftModel"],
        "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "draft_vocab_size": head.draft_vocab_size,
        "dtype": dtype,
        "eagle_aux_hidden_state_layer_ids": _layer_ids(src),
        "embed_requires_grad": False,
        **UNSUPPORTED_NORMS,
        **head.norms,
        "speculators_config": speculators_config(src, "eagle3", int(cfg.ttt_steps)),
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "transformer_layer_config": _layer_config(tcfg, _window(src)),
        "transformers_version": transformers.__version__,
        "draftsmith": _drafter_meta(src, "speculators"),
    }
    return conf


def spec_check(src: Source, weights: dict[str, torch.Tensor], where: str) -> None:
    if not _full_vocab(src):
        check_vocab(src, weights, where)


def spec_write_config(src: Source, out: Path) -> None:
    atomic_write_json(out / "config.json", spec_config(src))
    (out / "config.py").write_text(SPECULATORS_CONFIG_PY, encoding="utf-8")


# --------------------------------------------------------------------------------------------- SGLang


def _sgl_check_norms(src: Source) -> None:
    on = [k for k, v in _head(src).norms.items() if v]
    if on:
        raise ExportError(
            f"{src.drafter_dir}: an EAGLE-3 head trained with {on} cannot be written for SGLang: its "
            "LlamaForCausalLMEagle3 has no such norms (the head would draft with other math); use "
            "export=speculators, or train for SGLang with drafter=eagle3_sglang"
        )


def sgl_required(src: Source) -> dict[str, Shapes]:
    return _required(src, SGL_KEYS, vocab_maps=True)


def sgl_tensors(src: Source) -> dict[str, dict[str, torch.Tensor]]:
    _sgl_check_norms(src)
    if _window(src) is not None:
        raise ExportError(
            f"{src.drafter_dir}: a head with drafter.sliding_window={_window(src)} is not written for SGLang (its "
            "EAGLE-3 draft layer attends to the whole context); use export=speculators (vLLM reads the window)"
        )
    return SGLANG.mapped_tensors(src)


def sgl_config(src: Source) -> dict[str, Any]:
    tcfg = src.target_config
    head = _head(src)
    conf = clean_config(draft_layer_config(tcfg))  # a Llama layer of the target's dimensions
    ids = _layer_ids(src)
    n = int(tcfg.num_hidden_layers)
    conf.update(
        {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "draft_vocab_size": head.draft_vocab_size,
            "target_hidden_size": tcfg.hidden_size,
            "tie_word_embeddings": False,
            "dtype": str(next(head.parameters()).dtype).replace("torch.", ""),
        }
    )
    if ids != default_layer_ids(n):
        conf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids], "use_aux_hidden_state": True}
    conf["draftsmith"] = _drafter_meta(src, "sglang_eagle3")
    return conf


def sgl_write_config(src: Source, out: Path) -> None:
    atomic_write_json(out / "config.json", sgl_config(src))


# -------------------------------------------------------------------------------------------- importers


def _build(
    target: Any,
    layer_ids: list[int],
    state: dict[str, torch.Tensor],
    where: Path,
    norms: dict[str, bool] | None = None,
    window: int | None = None,
) -> Eagle3Head:
    tcfg = target.model.config
    if "lm_head.weight" not in state:
        raise ValueError(f"EAGLE-3 export {where} has no lm_head.weight")
    vd = int(state["lm_head.weight"].shape[0])
    V = int(tcfg.vocab_size)
    if "d2t" not in state and "t2d" not in state and vd == V:  # full vocabulary: identity maps (as speculators)
        state["d2t"] = torch.zeros(V, dtype=torch.long)
        state["t2d"] = torch.ones(V, dtype=torch.bool)
    if "d2t" not in state or "t2d" not in state:
        raise ValueError(f"EAGLE-3 export {where} has a {vd}-entry draft vocabulary but lacks d2t/t2d")
    check_vocab_maps(state["d2t"], state["t2d"], vd, V)
    embed = target.model.get_input_embeddings().weight.detach().cpu().float()
    stored = state.get("embed_tokens.weight")
    if stored is not None and not torch.equal(stored, embed.to(stored.dtype)):  # bf16 exports: the target's, rounded
        raise ValueError(f"EAGLE-3 export {where}: embed_tokens.weight is not the target's input embedding")
    state["embed_tokens.weight"] = embed
    head = Eagle3Head(tcfg, layer_ids, vd, norms, window)
    load_state(head, state, f"EAGLE-3 export {where}")
    return head.to(next(target.model.parameters()).dtype).eval()


def _check_hash(meta: dict[str, Any], state: dict[str, torch.Tensor], where: Path) -> None:
    expected = (meta.get("draftsmith") or {}).get("d2t_hash")
    if expected is not None and "d2t" in state and vocab_hash(state["d2t"]) != expected:
        raise ValueError(f"EAGLE-3 export {where}: d2t hash {vocab_hash(state['d2t'])} != recorded {expected}")


def spec_load(directory: Path, target: Any) -> Eagle3Head:
    """Import a speculators-format EAGLE-3 (ours or speculators') as an :class:`Eagle3Head`."""
    meta = read_config(directory)
    if meta.get("speculators_model_type") != "eagle3":
        raise ValueError(
            f"{directory} is not a speculators EAGLE-3 (speculators_model_type={meta.get('speculators_model_type')})"
        )
    layer = meta.get("transformer_layer_config") or {}
    tcfg = target.model.config
    if layer.get("hidden_size") != tcfg.hidden_size or layer.get("vocab_size") != tcfg.vocab_size:
        raise ValueError(
            f"{directory}: draft layer hidden/vocab {layer.get('hidden_size')}/{layer.get('vocab_size')} != target's"
        )
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"{directory}: {layer.get('num_hidden_layers')} draft layers; Eagle3Head has 1")
    bad = {k: meta.get(k, v) for k, v in UNSUPPORTED_NORMS.items() if bool(meta.get(k, v)) != v}
    if bad:
        raise ValueError(f"{directory}: norm flags {bad} describe math Eagle3Head does not have")
    norms = norm_flags(meta)
    n = int(tcfg.num_hidden_layers)
    ids = [int(i) for i in (meta.get("eagle_aux_hidden_state_layer_ids") or default_layer_ids(n))]
    state = read_weights(directory, WEIGHTS, SPEC_KEYS)
    rows = int(state["lm_head.weight"].shape[0])
    if int(meta.get("draft_vocab_size", -1)) != rows:
        raise ValueError(f"{directory}: draft_vocab_size={meta.get('draft_vocab_size')} but lm_head has {rows} rows")
    _check_hash(meta, state, directory)
    types = layer.get("layer_types") or ["full_attention"]
    if types not in (["full_attention"], ["sliding_attention"]):
        raise ValueError(f"{directory}: draft layer_types {types}; Eagle3Head has one full or sliding-window layer")
    window = int(layer["sliding_window"]) if types == ["sliding_attention"] else None
    return _build(target, ids, state, directory, norms, window)


def sgl_load(directory: Path, target: Any) -> Eagle3Head:
    """Import an SGLang-format EAGLE-3 (ours or SpecForge's) as an :class:`Eagle3Head`."""
    meta = read_config(directory)
    if meta.get("architectures") != ["LlamaForCausalLMEagle3"]:
        raise ValueError(f"{directory}: architectures {meta.get('architectures')} is not LlamaForCausalLMEagle3")
    tcfg = target.model.config
    if meta.get("hidden_size") != tcfg.hidden_size or meta.get("vocab_size") != tcfg.vocab_size:
        raise ValueError(f"{directory}: hidden/vocab {meta.get('hidden_size')}/{meta.get('vocab_size')} != target's")
    n = int(tcfg.num_hidden_layers)
    sgl_ids = (meta.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = [int(i) + 1 for i in sgl_ids] if sgl_ids else default_layer_ids(n)
    recorded = (meta.get("draftsmith") or {}).get("layer_ids")
    if recorded is not None and list(recorded) != ids:
        raise ValueError(f"{directory}: eagle_config layer ids give HF layers {ids}, draftsmith recorded {recorded}")
    state = read_weights(directory, WEIGHTS, SGL_KEYS)
    rows = int(state["lm_head.weight"].shape[0])
    if int(meta.get("draft_vocab_size", -1)) != rows:
        raise ValueError(f"{directory}: draft_vocab_size={meta.get('draft_vocab_size')} but lm_head has {rows} rows")
    _check_hash(meta, state, directory)
    return _build(target, ids, state, directory)


# ------------------------------------------------------------------------------------------------- probe


@torch.no_grad()
def probe(head: torch.nn.Module, target: Any) -> torch.Tensor:
    """Draft logits of two chained steps on real target features of a fixed sequence, plus the d2t map."""

    assert isinstance(head, Eagle3Head)
    model = target.model
    ids_layers = head.layer_ids
    ids = probe_ids(model.config.vocab_size).to(target.device)
    hs = model(input_ids=ids, output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i] for i in ids_layers], dim=-1)[:, :-2]
    T = feats.shape[1]
    pos = torch.arange(T, device=ids.device)[None]
    h1, _ = head(feats, ids[:, 1 : T + 1], pos)
    h2, _ = head(h1, ids[:, 2 : T + 2], pos + 1)  # the chain's next step: own output fed back, no fc
    logits = torch.cat([head.draft_logits(h1), head.draft_logits(h2)], dim=1).float()
    return torch.cat([logits.flatten(), head.target_ids().float().to(logits.device)])


SPECULATORS = register_format(
    Format(
        family="eagle3",
        name="speculators",
        doc="EAGLE-3 in the speculators/vLLM format (Eagle3DraftModel, speculators_config, layers.0.*, d2t, t2d)",
        weights=WEIGHTS,
        keys=SPEC_KEYS,
        tensors=spec_tensors,
        required=spec_required,
        check=spec_check,
        write_config=spec_write_config,
        load=spec_load,
        probe=probe,
    )
)
SGLANG = register_format(
    Format(
        family="eagle3",
        name="sglang_eagle3",
        doc="EAGLE-3 for SGLang (LlamaForCausalLMEagle3, midlayer.*, d2t, t2d)",
        weights=WEIGHTS,
        keys=SGL_KEYS,
        tensors=sgl_tensors,
        required=sgl_required,
        check=check_vocab,
        write_config=sgl_write_config,
        load=sgl_load,
        probe=probe,
    )
)
