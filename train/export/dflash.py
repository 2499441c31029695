"""DFlash drafts in the speculators / vLLM format (``speculators``) and in the native DFlash layout that SGLang and
vLLM both load (``sglang_dflash``).

Both hold the tensors of :class:`train.drafters.dflash.DFlashHead` under the same names (``layers.{i}.*`` with the
per-head ``q_norm``/``k_norm``, ``fc``, ``hidden_norm``, ``norm``; no embedding: the engines share the target's),
as the engines' loaders read them (vLLM ``qwen3_dflash.DFlashQwen3ForCausalLM``, SGLang ``models/dflash.py``,
speculators ``DFlashDraftModel``). What differs is the config and the vocabulary:

``speculators`` -- speculators 0.9's ``dflash`` config: ``speculators_model_type: dflash``,
``transformer_layer_config`` (a Qwen3 layer config of the target's dimensions, ``num_hidden_layers`` = the draft's
layers), ``aux_hidden_state_layer_ids`` (HF ``hidden_states`` indices: vLLM captures the residual stream entering
decoder layer ``i``, which is HF ``hidden_states[i]``), ``block_size``, ``mask_token_id``, ``draft_vocab_size`` and
``speculators_config`` (greedy proposal of ``block_size - 1`` tokens, verifier = the target directory).
``sliding_window_non_causal`` is written **true**: vLLM turns ``false`` (speculators' default) into a causal block
for every draft layer, while the draft was trained bidirectional inside the block (as speculators' trainer trains
full-attention layers). The draft LM head is always written (``lm_head.weight`` [draft_vocab, H]; vLLM uses a
shipped LM head, else the target's) with ``d2t``/``t2d`` for a reduced vocabulary.

``sglang_dflash`` -- the native layout (z-lab's): ``architectures: ["DFlashDraftModel"]``, ``model_type: qwen3``,
the draft layer's Qwen3 config, ``block_size``, ``num_target_layers`` and ``dflash_config: {mask_token_id,
target_layer_ids}`` with the target layers as 0-based indices of the decoder layer whose output is captured (HF
index - 1). SGLang's DFlash has no LM head of its own (it always uses the target's), so this format carries none and
refuses a draft whose LM head is not exactly the target's (train with ``drafter.draft_vocab_size=0
drafter.freeze_lm_head=true``).

Both refuse target layers the engines capture differently from the training features: HF index 0 (the embeddings)
and ``N`` (HF's last entry is after the final norm, the engines' is not).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from data.atomic import atomic_write_json
from data.target import output_head
from train.drafters.dflash import DFlashConfig, DFlashHead
from train.drafters.layers import draft_layer_config
from train.drafters.saving import load_state
from train.drafters.vocab import check_vocab_maps, vocab_hash
from train.export.core import (
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

from speculators.models.dflash import DFlashSpeculatorConfig

__all__ = ["DFlashSpeculatorConfig"]
'''

KEYS = KeyMap(drop=("rotary.", "embed_tokens.", "mask_token"))
"""Both formats store the module's own names, without the frozen embedding (the mask token goes into config.json)."""
NATIVE_KEYS = KeyMap(drop=("rotary.", "embed_tokens.", "mask_token", "lm_head.", "d2t", "t2d"))
"""The native layout also leaves the LM head and the vocabulary maps to the target."""

LAYER: ShapeTable = {
    "self_attn.q_proj.weight": ("q", "H"),
    "self_attn.k_proj.weight": ("kv", "H"),
    "self_attn.v_proj.weight": ("kv", "H"),
    "self_attn.o_proj.weight": ("H", "q"),
    "self_attn.q_norm.weight": ("hd",),
    "self_attn.k_norm.weight": ("hd",),
    "mlp.gate_proj.weight": ("I", "H"),
    "mlp.up_proj.weight": ("I", "H"),
    "mlp.down_proj.weight": ("H", "I"),
    "input_layernorm.weight": ("H",),
    "post_attention_layernorm.weight": ("H",),
}
HEAD: ShapeTable = {"fc.weight": ("H", "kH"), "hidden_norm.weight": ("H",), "norm.weight": ("H",)}
LM_HEAD: ShapeTable = {"lm_head.weight": ("vd", "H")}
VOCAB_MAPS: ShapeTable = {"d2t": ("vd",), "t2d": ("V",)}


def _head(src: Source) -> DFlashHead:
    if not isinstance(src.module, DFlashHead):
        raise ExportError(f"{src.drafter_dir}: expected a DFlash draft, got {type(src.module).__name__}")
    return src.module


def _layer_ids(src: Source) -> list[int]:
    head = _head(src)
    ids = head.layer_ids
    n = int(src.target_config.num_hidden_layers)
    bad = [i for i in ids if not 1 <= i <= n - 1]
    if bad:
        raise ExportError(
            f"{src.drafter_dir}: target layers {bad} (HF hidden_states indices) cannot be served: vLLM and SGLang "
            f"capture the output of decoder layers 1..{n - 1} before the final norm (0 = the embeddings and {n} = the "
            "final-normed states are not captured alike); train with drafter.layer_ids inside that range"
        )
    if ids != sorted(ids):
        raise ExportError(f"{src.drafter_dir}: the engines fuse the target layers in ascending order; got {ids}")
    return ids


def _full_vocab(src: Source) -> bool:
    return _head(src).draft_vocab_size == src.target_config.vocab_size


def _dims(src: Source) -> dict[str, int]:
    d = target_dims(src.target_config)
    head = _head(src)
    hd = head.layers[0].self_attn.head_dim
    return {**d, "hd": hd, "kH": len(head.layer_ids) * d["H"], "vd": head.draft_vocab_size}


def _required(src: Source, native: bool) -> dict[str, Shapes]:
    dims = _dims(src)
    tables = [HEAD] + ([] if native else [LM_HEAD] + ([] if _full_vocab(src) else [VOCAB_MAPS]))
    req = {k: v for t in tables for k, v in shapes(t, dims).items()}
    for i in range(len(_head(src).layers)):
        req.update(shapes(LAYER, dims, f"layers.{i}."))
    return {WEIGHTS: req}


def _check_vocab(src: Source, where: str) -> None:
    head = _head(src)
    try:
        check_vocab_maps(head.d2t.cpu(), head.t2d.cpu(), head.draft_vocab_size, src.target_config.vocab_size)
    except ValueError as e:
        raise ExportError(f"refusing to write {where}: {e}") from e
    expected = trained_d2t_hash(src)
    if expected is not None and vocab_hash(head.d2t.cpu()) != expected:
        raise ExportError(f"refusing to write {where}: d2t is not the vocabulary map the draft was trained with")


def _qwen3_layer_config(src: Source) -> dict[str, Any]:
    """The draft layers' config as the engines build them: Qwen3 (per-head q/k norms), the target's dimensions."""
    d = draft_layer_config(src.target_config)
    conf = clean_config(d)
    head = _head(src)
    conf.update(
        {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "num_hidden_layers": len(head.layers),
            "head_dim": head.layers[0].self_attn.head_dim,
            "layer_types": ["full_attention"] * len(head.layers),
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": len(head.layers),
            "tie_word_embeddings": False,
        }
    )
    for k in ("mlp_bias", "pretraining_tp", "bos_token_id", "eos_token_id", "pad_token_id"):
        conf.pop(k, None)
    return conf


def _drafter_meta(src: Source, fmt: str) -> dict[str, Any]:
    meta = src.provenance(fmt)
    meta["d2t_hash"] = vocab_hash(_head(src).d2t.cpu())
    meta["layer_ids"] = _head(src).layer_ids
    return meta


def _dtype(src: Source) -> str:
    return str(next(_head(src).parameters()).dtype).replace("torch.", "")


# ---------------------------------------------------------------------------------------- speculators


def spec_tensors(src: Source) -> dict[str, dict[str, torch.Tensor]]:
    _layer_ids(src)
    weights = SPECULATORS.mapped_tensors(src)
    if _full_vocab(src):  # as speculators: no d2t/t2d for the full vocabulary (vLLM refuses a d2t then)
        for k in ("d2t", "t2d"):
            weights[WEIGHTS].pop(k, None)
    return weights


def spec_config(src: Source) -> dict[str, Any]:
    import transformers

    head = _head(src)
    return {
        "architectures": ["DFlashSpeculator"],
        "auto_map": {"": "config.DFlashSpeculatorConfig"},
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "aux_hidden_state_layer_ids": _layer_ids(src),
        "block_size": head.block_size,
        "draft_vocab_size": head.draft_vocab_size,
        "mask_token_id": head.mask_token_id,
        "sample_from_anchor": False,
        "sliding_window_non_causal": True,
        "target_hidden_size": None,
        "dtype": _dtype(src),
        "speculators_config": speculators_config(src, "dflash", head.block_size - 1),
        "transformer_layer_config": _qwen3_layer_config(src),
        "transformers_version": transformers.__version__,
        "draftsmith": _drafter_meta(src, "speculators"),
    }


def spec_check(src: Source, weights: dict[str, torch.Tensor], where: str) -> None:
    _check_vocab(src, where)


def spec_write_config(src: Source, out: Path) -> None:
    atomic_write_json(out / "config.json", spec_config(src))
    (out / "config.py").write_text(SPECULATORS_CONFIG_PY, encoding="utf-8")


# ------------------------------------------------------------------------------------------ native (SGLang)


def _native_check(src: Source) -> None:
    head = _head(src)
    target_head = output_head(src.target.model)
    same = _full_vocab(src) and torch.equal(
        head.lm_head.weight.detach().cpu().float(), target_head.weight.detach().cpu().float()
    )
    if not same or getattr(target_head, "bias", None) is not None:
        raise ExportError(
            f"{src.drafter_dir}: SGLang's DFlash drafts through the target's own LM head, and this draft has its own "
            f"({head.draft_vocab_size} rows, trained): it would draft with other math there. Train with "
            "drafter.draft_vocab_size=0 drafter.freeze_lm_head=true for SGLang, or use export=speculators (vLLM)"
        )


def native_tensors(src: Source) -> dict[str, dict[str, torch.Tensor]]:
    _layer_ids(src)
    _native_check(src)
    return NATIVE.mapped_tensors(src)


def native_config(src: Source) -> dict[str, Any]:
    head = _head(src)
    conf = _qwen3_layer_config(src)
    conf.update(
        {
            "architectures": ["DFlashDraftModel"],
            "block_size": head.block_size,
            "num_target_layers": int(src.target_config.num_hidden_layers),
            "dflash_config": {
                "mask_token_id": head.mask_token_id,
                "target_layer_ids": [i - 1 for i in _layer_ids(src)],
            },
            "dtype": _dtype(src),
        }
    )
    conf["draftsmith"] = _drafter_meta(src, "sglang_dflash")
    return conf


def native_write_config(src: Source, out: Path) -> None:
    atomic_write_json(out / "config.json", native_config(src))


# -------------------------------------------------------------------------------------------- importers


def _build(
    target: Any, layer_ids: list[int], block_size: int, mask: int, state: dict[str, torch.Tensor], where: Path
) -> DFlashHead:
    tcfg = target.model.config
    V = int(tcfg.vocab_size)
    if "lm_head.weight" not in state:  # the native layout: the target's LM head, the full vocabulary
        state["lm_head.weight"] = output_head(target.model).weight.detach().cpu().float()
    vd = int(state["lm_head.weight"].shape[0])
    if "d2t" not in state and "t2d" not in state and vd == V:
        state["d2t"] = torch.zeros(V, dtype=torch.long)
        state["t2d"] = torch.ones(V, dtype=torch.bool)
    if "d2t" not in state or "t2d" not in state:
        raise ValueError(f"DFlash export {where} has a {vd}-entry draft vocabulary but lacks d2t/t2d")
    check_vocab_maps(state["d2t"], state["t2d"], vd, V)
    layers = sorted({int(k.split(".")[1]) for k in state if k.startswith("layers.")})
    state["embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach().cpu().float()
    state["mask_token"] = torch.tensor([int(mask)], dtype=torch.long)
    head = DFlashHead(tcfg, layer_ids, len(layers), block_size, vd, mask)
    load_state(head, state, f"DFlash export {where}")
    return head.to(next(target.model.parameters()).dtype).eval()


def _check_target(layer: dict[str, Any], target: Any, where: Path) -> None:
    tcfg = target.model.config
    if layer.get("hidden_size") != tcfg.hidden_size or layer.get("vocab_size") != tcfg.vocab_size:
        raise ValueError(
            f"{where}: draft layer hidden/vocab {layer.get('hidden_size')}/{layer.get('vocab_size')} != target's"
        )


def spec_load(directory: Path, target: Any) -> DFlashHead:
    """Import a speculators-format DFlash draft as a :class:`DFlashHead`."""
    meta = read_config(directory)
    if meta.get("speculators_model_type") != "dflash":
        raise ValueError(
            f"{directory} is not a speculators DFlash (speculators_model_type={meta.get('speculators_model_type')})"
        )
    _check_target(meta.get("transformer_layer_config") or {}, target, directory)
    if not meta.get("sliding_window_non_causal") or meta.get("sample_from_anchor"):
        raise ValueError(f"{directory}: a causal block or sample_from_anchor is not the math DFlashHead drafts with")
    state = read_weights(directory, WEIGHTS, KEYS)
    ids = [int(i) for i in meta["aux_hidden_state_layer_ids"]]
    return _build(target, ids, int(meta["block_size"]), int(meta["mask_token_id"]), state, directory)


def native_load(directory: Path, target: Any) -> DFlashHead:
    """Import a native (SGLang / z-lab) DFlash draft as a :class:`DFlashHead`."""
    meta = read_config(directory)
    if meta.get("architectures") != ["DFlashDraftModel"]:
        raise ValueError(f"{directory}: architectures {meta.get('architectures')} is not DFlashDraftModel")
    _check_target(meta, target, directory)
    dcfg = meta.get("dflash_config") or {}
    if dcfg.get("causal") or meta.get("is_causal"):
        raise ValueError(f"{directory}: a causal block is not the math DFlashHead drafts with")
    state = read_weights(directory, WEIGHTS, NATIVE_KEYS)
    ids = [int(i) + 1 for i in dcfg["target_layer_ids"]]
    return _build(target, ids, int(meta["block_size"]), int(dcfg["mask_token_id"]), state, directory)


# ------------------------------------------------------------------------------------------------- probe


@torch.no_grad()
def probe(head: torch.nn.Module, target: Any) -> torch.Tensor:
    """Draft logits of blocks after three prefixes of a fixed sequence, on its real target features, plus the
    draft vocabulary's target ids and the mask token."""
    assert isinstance(head, DFlashHead)
    ids = probe_ids(target.model.config.vocab_size).to(target.device)
    hs = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    rows = head.fuse(torch.cat([hs[i] for i in head.layer_ids], dim=-1))
    T = ids.shape[1]
    out = []
    for a in (4, T // 2, T - 1):
        ctx = head.context_kv(rows[:, :a], torch.arange(a, device=ids.device)[None])
        pos = (a + torch.arange(head.block_size, device=ids.device))[None]
        h = head.hidden(head.block_ids(ids[:, a]), pos, ctx, None)[:, 1:]
        out.append(head.draft_logits(h).float().flatten())
    out += [head.target_ids().float().to(ids.device), head.mask_token.float().to(ids.device)]
    return torch.cat(out)


SPECULATORS = register_format(
    Format(
        family="dflash",
        name="speculators",
        doc="DFlash in the speculators/vLLM format (speculators_model_type dflash, layers.*, fc, lm_head, d2t, t2d)",
        weights=WEIGHTS,
        keys=KEYS,
        tensors=spec_tensors,
        required=lambda src: _required(src, native=False),
        check=spec_check,
        write_config=spec_write_config,
        load=spec_load,
        probe=probe,
    )
)
NATIVE = register_format(
    Format(
        family="dflash",
        name="sglang_dflash",
        doc="DFlash in the native layout SGLang and vLLM load (DFlashDraftModel, dflash_config; the target's LM head)",
        weights=WEIGHTS,
        keys=NATIVE_KEYS,
        tensors=native_tensors,
        required=lambda src: _required(src, native=True),
        write_config=native_write_config,
        load=native_load,
        probe=probe,
    )
)

__all__ = ["NATIVE", "SPECULATORS", "DFlashConfig"]
