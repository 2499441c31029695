"""EAGLE-1/2 heads: the EAGLE repository's layout (``eagle``), SGLang's ``LlamaForCausalLMEagle`` (``sglang_eagle``)
and vLLM's ``EagleLlamaForCausalLM`` (``vllm_eagle``).

Both hold the same weights (SafeAILab/EAGLE ``eagle/model/cnets1.py``): ``fc.weight`` [H, 2H], ``fc.bias``
[H], ``layers.{l}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{l}.mlp.{gate,up,down}_proj.weight``,
``layers.{l}.post_attention_layernorm.weight`` (layer 0 has no ``input_layernorm``; later layers do) and
``embed_tokens.weight`` [V, H]; the LM head is the target's. ``config.json`` is a plain LlamaConfig with
``num_hidden_layers`` = the head's layers; only ``architectures`` differs between the two formats.

vLLM (``vllm/model_executor/models/llama_eagle.py``, checked at vLLM 0.32) builds ``fc`` without a bias and its
weight loader drops unexpected ``.bias`` tensors without a word (its rule for GPTQ checkpoints): served from the
``eagle`` layout, the head loses its bias and its drafts are rejected (measured: 0 of 167 drafts accepted where our
decoder accepts 76). ``vllm_eagle`` folds the bias into the head's own token embedding instead, exactly:
``fc([e, f]) = W_e e + W_f f + b = W_e (e + c) + W_f f`` with ``c`` solving ``W_e c = b`` (``W_e``: the square
embedding half of ``fc.weight``, solved in float64), and writes no ``fc.bias``. vLLM keeps a draft embedding that
differs from the target's (it shares the target's only when they are identical).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from data.atomic import atomic_write_json
from train.drafters.eagle import EagleHead
from train.drafters.layers import draft_layer_config
from train.drafters.saving import load_state
from train.export.core import (
    LLAMA_LAYER,
    ExportError,
    Format,
    KeyMap,
    Shapes,
    ShapeTable,
    Source,
    clean_config,
    contiguous,
    probe_ids,
    read_config,
    read_weights,
    register_format,
    shapes,
    target_dims,
)

WEIGHTS = "model.safetensors"
KEYS = KeyMap(drop=("rotary.",))
"""The module's own names are the EAGLE repository's (the rotary cache is not a weight)."""
HEAD: ShapeTable = {"embed_tokens.weight": ("V", "H"), "fc.weight": ("H", "2H"), "fc.bias": ("H",)}
LAYER: ShapeTable = LLAMA_LAYER
LATER_LAYER: ShapeTable = {**LLAMA_LAYER, "input_layernorm.weight": ("H",)}
"""Layer 0 has no ``input_layernorm`` (its input is the fused feature); later layers do."""


def required(src: Source) -> dict[str, Shapes]:
    d = target_dims(src.target_config)
    dims = {**d, "A": d["H"], "2H": 2 * d["H"]}
    req = shapes(HEAD, dims)
    for layer in range(src.drafter_cfg.num_layers):
        req.update(shapes(LATER_LAYER if layer else LAYER, dims, f"layers.{layer}."))
    return {WEIGHTS: req}


def _config_writer(architecture: str, fmt: str) -> Any:
    def write_config(src: Source, out: Path) -> None:
        conf = clean_config(draft_layer_config(src.target_config))  # a Llama layer of the target's dimensions
        conf.update(
            {
                "tie_word_embeddings": bool(getattr(src.target_config, "tie_word_embeddings", False)),
                "architectures": [architecture],
                "model_type": "llama",
                "num_hidden_layers": src.drafter_cfg.num_layers,
                "bias": True,  # EAGLE's cnets: fc has a bias
            }
        )
        conf["draftsmith"] = src.provenance(fmt)
        atomic_write_json(out / "config.json", conf)

    return write_config


def load(directory: Path, target: Any) -> torch.nn.Module:
    """Import an EAGLE-layout head (ours or the EAGLE repository's, in safetensors) as the project's EagleHead."""
    from transformers import LlamaConfig

    meta = read_config(directory)
    tcfg = target.model.config
    if meta.get("hidden_size") != tcfg.hidden_size or meta.get("vocab_size") != tcfg.vocab_size:
        raise ValueError(
            f"EAGLE head in {directory} has hidden_size={meta.get('hidden_size')}, vocab_size="
            f"{meta.get('vocab_size')}; the target has {tcfg.hidden_size}, {tcfg.vocab_size}"
        )
    fields = {k: v for k, v in meta.items() if k not in ("draftsmith", "architectures", "model_type")}
    head = EagleHead(LlamaConfig(**fields), int(meta["num_hidden_layers"]))
    load_state(head, read_weights(directory, WEIGHTS, KEYS), f"EAGLE export {directory}")
    return head.to(next(target.model.parameters()).dtype).eval()


@torch.no_grad()
def probe(head: torch.nn.Module, target: Any) -> torch.Tensor:
    """Draft logits of the head on real target features of a fixed token sequence."""
    model = target.model
    ids = probe_ids(model.config.vocab_size).to(target.device)
    f = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    pos = torch.arange(ids.shape[1] - 1, device=ids.device)[None]
    pred, _ = head(f[:, :-1], ids[:, 1:], pos)
    return model.get_output_embeddings()(pred)


VLLM_HEAD: ShapeTable = {"embed_tokens.weight": ("V", "H"), "fc.weight": ("H", "2H")}
MAX_CONDITION = 1e6
"""The largest condition number of ``W_e`` the fold accepts: float32 keeps ~7 digits, so beyond this the folded
embedding would carry visible rounding (a random or trained ``W_e`` of these heads is near 1e1-1e3)."""


def vllm_required(src: Source) -> dict[str, Shapes]:
    req = required(src)[WEIGHTS]
    del req["fc.bias"]
    return {WEIGHTS: req}


def fold_fc_bias(state: dict[str, torch.Tensor], where: str = "vllm_eagle export") -> dict[str, torch.Tensor]:
    """``state`` (EAGLE names) with ``fc.bias`` folded into ``embed_tokens.weight`` (see the module docstring)."""
    out = dict(state)
    bias = out.pop("fc.bias")
    w = out["fc.weight"].double()
    h = w.shape[0]
    w_e = w[:, :h]  # fc's input is [embedding, feature]: the embedding half
    cond = float(torch.linalg.cond(w_e))
    if not cond < MAX_CONDITION:
        raise ExportError(
            f"refusing to write {where}: fc's embedding half is ill-conditioned (condition number {cond:.3g}), so "
            f"its bias cannot be folded into the embedding exactly; use export.format=eagle (EAGLE's own layout, "
            f"with the bias) or sglang_eagle"
        )
    c = torch.linalg.solve(w_e, bias.double())
    emb = out["embed_tokens.weight"]
    out["embed_tokens.weight"] = (emb.double() + c[None, :]).to(emb.dtype).contiguous()
    return out


def vllm_tensors(src: Source) -> dict[str, dict[str, torch.Tensor]]:
    state = contiguous(KEYS.to_file(src.module.state_dict()))
    return {WEIGHTS: fold_fc_bias(state, f"eagle -> vllm_eagle export of {src.drafter_dir}")}


def vllm_load(directory: Path, target: Any) -> torch.nn.Module:
    """Import a ``vllm_eagle`` head: the EAGLE layout without ``fc.bias`` (a zero bias: it lives in the embedding)."""
    from transformers import LlamaConfig

    meta = read_config(directory)
    fields = {k: v for k, v in meta.items() if k not in ("draftsmith", "architectures", "model_type")}
    head = EagleHead(LlamaConfig(**fields), int(meta["num_hidden_layers"]))
    state = dict(read_weights(directory, WEIGHTS, KEYS))
    state["fc.bias"] = torch.zeros(head.fc.out_features, dtype=state["fc.weight"].dtype)
    load_state(head, state, f"vllm_eagle export {directory}")
    return head.to(next(target.model.parameters()).dtype).eval()


def _vllm_config(src: Source, out: Path) -> None:
    _config_writer("LlamaForCausalLM", "vllm_eagle")(src, out)
    conf = read_config(out)
    conf["bias"] = False  # the bias is in the embedding (vLLM's fc has none)
    atomic_write_json(out / "config.json", conf)


register_format(
    Format(
        family="eagle",
        name="vllm_eagle",
        doc="EAGLE-1/2 head for vLLM (method eagle): fc's bias folded into the head's own embedding",
        weights=WEIGHTS,
        keys=KEYS,
        required=vllm_required,
        write_config=_vllm_config,
        load=vllm_load,
        probe=probe,
        tensors=vllm_tensors,
        # the fold rewrites every embedding row in float32 (rounding ~6e-8 relative each): measured 1.7e-5 on the
        # logits of a trained head; a lost or misplaced bias moves them by whole units
        round_trip_atol=1e-3,
    )
)

FORMATS = {
    name: register_format(
        Format(
            family="eagle",
            name=name,
            doc=doc,
            weights=WEIGHTS,
            keys=KEYS,
            required=required,
            write_config=_config_writer(arch, name),
            load=load,
            probe=probe,
        )
    )
    for name, arch, doc in (
        ("eagle", "LlamaForCausalLM", "EAGLE-1/2 head in the EAGLE repository's layout (plain LlamaConfig, 1 layer)"),
        ("sglang_eagle", "LlamaForCausalLMEagle", "EAGLE-1/2 head for SGLang (LlamaForCausalLMEagle)"),
    )
}
