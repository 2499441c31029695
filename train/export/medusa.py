"""Medusa heads in the Medusa repository's layout (``medusa``).

FasterDecoding/Medusa (``medusa/model/medusa_model_legacy.py``): ``config.json`` holds MedusaConfig fields
(``medusa_num_heads``, ``medusa_num_layers``, ``base_model_name_or_path``, ``version``) and
``medusa_lm_head.safetensors`` the heads: ``{i}.{j}.linear.weight`` [H, H] / ``{i}.{j}.linear.bias`` [H]
(head i, ResBlock j: ``x + SiLU(Linear(x))``); with per-head vocabulary projections (version 1,
``own_lm_head=True``) also ``{i}.{L}.weight`` [V, H]. Version "2": the heads reuse the target's LM head.
The project's module names the same tensors ``heads.{i}.{j}.linear.*`` (and ``heads.{i}.{L}.weight``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from data.atomic import atomic_write_json
from data.target import output_head
from train.drafters.registry import get
from train.export.core import (
    ExportError,
    Format,
    KeyMap,
    Shapes,
    ShapeTable,
    Source,
    probe_ids,
    read_config,
    read_weights,
    register_format,
    shapes,
)

WEIGHTS = "medusa_lm_head.safetensors"
PREFIX = "heads."
KEYS = KeyMap(rename=((PREFIX, ""),), drop=("rank_hits", "rank_count"))
"""The heads without our ``heads.`` prefix; the rank statistics go into config.json, not the weight file."""
RESBLOCK: ShapeTable = {"linear.weight": ("H", "H"), "linear.bias": ("H",)}
OWN_LM_HEAD: ShapeTable = {"weight": ("V", "H")}


def required(src: Source) -> dict[str, Shapes]:
    c = src.drafter_cfg
    dims = {"H": src.target_config.hidden_size, "V": src.target_config.vocab_size}
    req: Shapes = {}
    for i in range(c.num_heads):
        for j in range(c.num_layers):
            req.update(shapes(RESBLOCK, dims, f"{PREFIX}{i}.{j}."))
        if c.own_lm_head:
            req.update(shapes(OWN_LM_HEAD, dims, f"{PREFIX}{i}.{c.num_layers}."))
    return {WEIGHTS: KEYS.to_file(req)}


def write_config(src: Source, out: Path) -> None:
    c = src.drafter_cfg
    tc = src.target_config
    conf = {
        "architectures": ["MedusaModel"],
        "medusa_num_heads": c.num_heads,
        "medusa_num_layers": c.num_layers,
        "base_model_name_or_path": str(src.target.path),
        "version": "1" if c.own_lm_head else "2",
        "hidden_size": tc.hidden_size,
        "vocab_size": tc.vocab_size,
        "draftsmith": src.provenance("medusa"),
    }
    # Non-weight state the project's decoder uses (per-head rank accuracies -> the default static tree): kept
    # in config.json, since medusa_lm_head.safetensors holds exactly the Medusa repository's tensors.
    buffers = {k: v.tolist() for k, v in src.module.state_dict().items() if not k.startswith(PREFIX)}
    conf["draftsmith"]["buffers"] = buffers
    atomic_write_json(out / "config.json", conf)


def load(directory: Path, target: Any) -> torch.nn.Module:
    """Import a Medusa export as the project's medusa module (built by the family, heads loaded strictly)."""

    meta = read_config(directory)
    spec = get("medusa")
    saved = (meta.get("draftsmith") or {}).get("drafter") or {}
    cfg = spec.config_cls(**saved) if saved else spec.config_cls()
    cfg.num_heads, cfg.num_layers = int(meta["medusa_num_heads"]), int(meta["medusa_num_layers"])
    cfg.own_lm_head = str(meta.get("version", "2")) == "1"
    module = spec.build(cfg, target.model)
    heads = read_weights(directory, WEIGHTS, KEYS)
    own = module.state_dict()
    missing = [k for k in own if k.startswith(PREFIX) and k not in heads]
    unexpected = [k for k in heads if k not in own]
    if missing or unexpected:
        raise ExportError(f"Medusa export {directory}: missing {missing}, unexpected {unexpected}")
    buffers = {k: torch.tensor(v) for k, v in ((meta.get("draftsmith") or {}).get("buffers") or {}).items()}
    module.load_state_dict({**heads, **buffers}, strict=False)
    return module.eval()


@torch.no_grad()
def probe(module: torch.nn.Module, target: Any) -> torch.Tensor:
    """Every head's draft logits on the target's last hidden states of a fixed token sequence."""

    model = target.model
    ids = probe_ids(model.config.vocab_size).to(target.device)
    h = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    out = module(h)
    if isinstance(out, list | tuple):
        out = torch.stack(list(out))
    if out.shape[-1] == model.config.hidden_size:  # heads return features; the LM head is the target's
        out = model.get_output_embeddings()(out)
    return out


register_format(
    Format(
        family="medusa",
        name="medusa",
        doc="Medusa heads in the Medusa repository's layout (MedusaConfig + medusa_lm_head.safetensors)",
        weights=WEIGHTS,
        keys=KEYS,
        required=required,
        write_config=write_config,
        load=load,
        probe=probe,
    )
)


# -- vLLM's Medusa (``vllm_medusa``) -------------------------------------------------------------------------------

VLLM_WEIGHTS = "model.safetensors"
VLLM_KEYS = KeyMap(drop=("rank_hits", "rank_count"))
"""Not used for names (the mapping below inserts the block index): the buffers stay in config.json as above."""


def _vllm_name(key: str, num_layers: int) -> str | None:
    """Our name -> vLLM's MedusaModel name: ``heads.{i}.{j}.linear.{w}`` -> ``blocks.{i}.layers.{j}.{w}``, and
    ``heads.{i}.{L}.weight`` (an own LM head) -> ``lm_heads.{i}.weight``."""
    parts = key.split(".")
    if parts[0] != "heads":
        return None
    i, j = parts[1], int(parts[2])
    if j == num_layers:
        return f"lm_heads.{i}.weight"
    return f"blocks.{i}.layers.{j}.{parts[-1]}"


def _check_vllm(src: Source) -> None:
    head = output_head(src.target.model)
    where = f"medusa -> vllm_medusa export of {src.drafter_dir}"
    if head.softcap:
        raise ExportError(
            f"refusing to write {where}: the target caps its logits (final_logit_softcapping={head.softcap}), which "
            f"vLLM's Medusa model does not; use export.format=medusa"
        )
    if head.bias is not None:
        raise ExportError(f"refusing to write {where}: the target's LM head has a bias, vLLM's Medusa heads do not")


def vllm_tensors(src: Source) -> dict[str, dict[str, torch.Tensor]]:
    _check_vllm(src)
    c = src.drafter_cfg
    out: dict[str, torch.Tensor] = {}
    for k, v in src.module.state_dict().items():
        name = _vllm_name(k, c.num_layers)
        if name is not None:
            out[name] = v.detach().contiguous()
    if not c.own_lm_head:  # Medusa-2 heads share the target's LM head: vLLM reads it once (original_lm_head)
        out["lm_heads.0.weight"] = output_head(src.target.model).weight.detach().to(torch.float32).contiguous().clone()
    return {VLLM_WEIGHTS: out}


def vllm_required(src: Source) -> dict[str, Shapes]:
    c = src.drafter_cfg
    h, v = src.target_config.hidden_size, src.target_config.vocab_size
    req: Shapes = {}
    for i in range(c.num_heads):
        for j in range(c.num_layers):
            req[f"blocks.{i}.layers.{j}.weight"] = (h, h)
            req[f"blocks.{i}.layers.{j}.bias"] = (h,)
        if c.own_lm_head:
            req[f"lm_heads.{i}.weight"] = (v, h)
    if not c.own_lm_head:
        req["lm_heads.0.weight"] = (v, h)
    return {VLLM_WEIGHTS: req}


def vllm_write_config(src: Source, out: Path) -> None:
    c = src.drafter_cfg
    tc = src.target_config
    conf = {
        "architectures": ["MedusaModel"],
        "num_heads": c.num_heads,
        "num_hidden_layers": c.num_layers,
        "hidden_size": tc.hidden_size,
        "vocab_size": tc.vocab_size,
        "truncated_vocab_size": tc.vocab_size,
        "medusa_fc_bias": True,  # the residual blocks' Linear has a bias (vLLM drops it silently otherwise)
        "original_lm_head": not c.own_lm_head,
        "logit_scale": output_head(src.target.model).scale,
        "draftsmith": src.provenance("vllm_medusa"),
    }
    conf["draftsmith"]["buffers"] = {
        k: v.tolist() for k, v in src.module.state_dict().items() if not k.startswith(PREFIX)
    }
    atomic_write_json(out / "config.json", conf)


def vllm_load(directory: Path, target: Any) -> torch.nn.Module:
    """Import a ``vllm_medusa`` export as the project's medusa module (names mapped back, loaded strictly)."""
    meta = read_config(directory)
    spec = get("medusa")
    saved = (meta.get("draftsmith") or {}).get("drafter") or {}
    cfg = spec.config_cls(**saved) if saved else spec.config_cls()
    cfg.num_heads, cfg.num_layers = int(meta["num_heads"]), int(meta["num_hidden_layers"])
    cfg.own_lm_head = not meta.get("original_lm_head", False)
    module = spec.build(cfg, target.model)
    names = {_vllm_name(k, cfg.num_layers): k for k in module.state_dict() if k.startswith(PREFIX)}
    weights = read_weights(directory, VLLM_WEIGHTS, VLLM_KEYS)
    if not cfg.own_lm_head:
        weights = {k: v for k, v in weights.items() if k != "lm_heads.0.weight"}
    missing = [n for n in names if n not in weights]
    unexpected = [n for n in weights if n not in names]
    if missing or unexpected:
        raise ExportError(f"vLLM Medusa export {directory}: missing {missing}, unexpected {unexpected}")
    buffers = {k: torch.tensor(v) for k, v in ((meta.get("draftsmith") or {}).get("buffers") or {}).items()}
    module.load_state_dict({**{names[n]: t for n, t in weights.items()}, **buffers}, strict=False)
    return module.eval()


register_format(
    Format(
        family="medusa",
        name="vllm_medusa",
        doc="Medusa heads for vLLM (method medusa): its MedusaModel names, the residual blocks' bias declared, the "
        "target's LM head included once (original_lm_head) when the heads share it",
        weights=VLLM_WEIGHTS,
        keys=VLLM_KEYS,
        required=vllm_required,
        write_config=vllm_write_config,
        load=vllm_load,
        probe=probe,
        tensors=vllm_tensors,
    )
)
