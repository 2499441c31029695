"""EAGLE-1/2 heads: the EAGLE repository's layout (``eagle``) and SGLang's ``LlamaForCausalLMEagle`` (``sglang_eagle``).

Both hold the same weights (SafeAILab/EAGLE ``eagle/model/cnets1.py``): ``fc.weight`` [H, 2H], ``fc.bias``
[H], ``layers.{l}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{l}.mlp.{gate,up,down}_proj.weight``,
``layers.{l}.post_attention_layernorm.weight`` (layer 0 has no ``input_layernorm``; later layers do) and
``embed_tokens.weight`` [V, H]; the LM head is the target's. ``config.json`` is a plain LlamaConfig with
``num_hidden_layers`` = the head's layers; only ``architectures`` differs between the two formats.
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
