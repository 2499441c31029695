"""EAGLE-1/2 heads: the EAGLE repository's layout (``eagle``) and SGLang's ``LlamaForCausalLMEagle`` (``sglang_eagle``).

Both hold the same weights (SafeAILab/EAGLE ``eagle/model/cnets1.py``): ``fc.weight`` [H, 2H], ``fc.bias``
[H], ``layers.{l}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{l}.mlp.{gate,up,down}_proj.weight``,
``layers.{l}.post_attention_layernorm.weight`` (layer 0 has no ``input_layernorm``; later layers do) and
``embed_tokens.weight`` [V, H]; the LM head is the target's. ``config.json`` is a plain LlamaConfig with
``num_hidden_layers`` = the head's layers; only ``architectures`` differs between the two formats.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from data.atomic import atomic_write_json
from train.drafters.eagle import EagleHead
from train.export.core import Format, Shapes, Source, clean_config, contiguous, register_format, target_dims

WEIGHTS = "model.safetensors"


def required(src: Source) -> dict[str, Shapes]:
    d = target_dims(src.target_config)
    H, V, I_, q, kv = d["H"], d["V"], d["I"], d["q"], d["kv"]
    req: Shapes = {"embed_tokens.weight": (V, H), "fc.weight": (H, 2 * H), "fc.bias": (H,)}
    for layer in range(src.drafter_cfg.num_layers):
        p = f"layers.{layer}."
        req.update(
            {
                p + "self_attn.q_proj.weight": (q, H),
                p + "self_attn.k_proj.weight": (kv, H),
                p + "self_attn.v_proj.weight": (kv, H),
                p + "self_attn.o_proj.weight": (H, q),
                p + "mlp.gate_proj.weight": (I_, H),
                p + "mlp.up_proj.weight": (I_, H),
                p + "mlp.down_proj.weight": (H, I_),
                p + "post_attention_layernorm.weight": (H,),
            }
        )
        if layer > 0:
            req[p + "input_layernorm.weight"] = (H,)
    return {WEIGHTS: req}


def tensors(src: Source) -> dict[str, dict[str, torch.Tensor]]:
    state = {k: v for k, v in src.module.state_dict().items() if not k.startswith("rotary.")}
    return {WEIGHTS: contiguous(state)}


def _config(src: Source, architecture: str, fmt: str) -> dict[str, Any]:
    conf = clean_config(src.target_config)
    conf.update(
        {
            "architectures": [architecture],
            "model_type": "llama",
            "num_hidden_layers": src.drafter_cfg.num_layers,
            "bias": True,  # EAGLE's cnets: fc has a bias
        }
    )
    conf["draftsmith"] = src.provenance(fmt)
    return conf


def _writer(architecture: str, fmt: str) -> Any:
    def write(src: Source, out: Path, weights: dict[str, dict[str, torch.Tensor]]) -> None:
        save_file(weights[WEIGHTS], str(out / WEIGHTS), metadata={"format": "pt"})
        atomic_write_json(out / "config.json", _config(src, architecture, fmt))

    return write


def load(directory: Path, target: Any) -> torch.nn.Module:
    """Import an EAGLE-layout head (ours or the EAGLE repository's, in safetensors) as the project's EagleHead."""
    from transformers import LlamaConfig

    meta = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    tcfg = target.model.config
    if meta.get("hidden_size") != tcfg.hidden_size or meta.get("vocab_size") != tcfg.vocab_size:
        raise ValueError(
            f"EAGLE head in {directory} has hidden_size={meta.get('hidden_size')}, vocab_size="
            f"{meta.get('vocab_size')}; the target has {tcfg.hidden_size}, {tcfg.vocab_size}"
        )
    fields = {k: v for k, v in meta.items() if k not in ("draftsmith", "architectures", "model_type")}
    head = EagleHead(LlamaConfig(**fields), int(meta["num_hidden_layers"]))
    missing, unexpected = head.load_state_dict(load_file(str(directory / WEIGHTS)), strict=False)
    missing = [k for k in missing if not k.startswith("rotary.")]
    if missing or unexpected:
        raise ValueError(f"EAGLE export {directory}: missing {missing}, unexpected {unexpected}")
    return head.to(next(target.model.parameters()).dtype).eval()


PROBE_LEN = 24


def probe_ids(vocab: int, n: int = PROBE_LEN) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(3, vocab, (1, n), generator=g)


@torch.no_grad()
def probe(head: torch.nn.Module, target: Any) -> torch.Tensor:
    """Draft logits of the head on real target features of a fixed token sequence."""
    model = target.model
    ids = probe_ids(model.config.vocab_size).to(target.device)
    f = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    pos = torch.arange(ids.shape[1] - 1, device=ids.device)[None]
    pred, _ = head(f[:, :-1], ids[:, 1:], pos)
    return model.get_output_embeddings()(pred)


for _name, _arch, _doc in (
    ("eagle", "LlamaForCausalLM", "EAGLE-1/2 head in the EAGLE repository's layout (plain LlamaConfig, 1 layer)"),
    ("sglang_eagle", "LlamaForCausalLMEagle", "EAGLE-1/2 head for SGLang (LlamaForCausalLMEagle)"),
):
    register_format(
        Format(
            family="eagle",
            name=_name,
            doc=_doc,
            tensors=tensors,
            required=required,
            write=_writer(_arch, _name),
            load=load,
            probe=probe,
        )
    )
