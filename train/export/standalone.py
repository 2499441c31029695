"""Standalone draft models as a plain Hugging Face directory (``hf``).

``config.json`` + ``model.safetensors`` + the target's tokenizer files: vLLM takes the directory as
``speculative_config={"model": dir, "num_speculative_tokens": K}``, transformers as
``generate(assistant_model=AutoModelForCausalLM.from_pretrained(dir))``. The draft must share the target's
vocabulary (its embedding/LM head rows are checked against the target's vocab size).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from data.atomic import atomic_write_json
from train.drafters.registry import get
from train.export.core import Format, KeyMap, Shapes, Source, clean_config, contiguous, probe_ids, register_format

WEIGHTS = "model.safetensors"


def hf_model(module: torch.nn.Module) -> Any:
    """The transformers causal LM inside a standalone drafter (the module itself, or its ``.model``)."""
    from transformers import PreTrainedModel

    if isinstance(module, PreTrainedModel):
        return module
    inner = getattr(module, "model", None)
    if isinstance(inner, PreTrainedModel):
        return inner
    raise TypeError(f"standalone drafter {type(module).__name__} holds no transformers PreTrainedModel")


def _tied(model: Any) -> bool:
    conf = model.config
    tied = getattr(conf, "tie_word_embeddings", None)
    if tied is None and hasattr(conf, "get_text_config"):
        tied = getattr(conf.get_text_config(), "tie_word_embeddings", False)
    return bool(tied)


def _name_of(model: Any, tensor: torch.Tensor, state: dict[str, torch.Tensor]) -> str:
    for name, p in model.named_parameters(remove_duplicate=False):
        if p is tensor and name in state:
            return name
    raise ValueError(f"{type(model).__name__}: its embedding / LM head is not among its parameters")


def required_for(model: Any, vocab: int) -> dict[str, Shapes]:
    """Every tensor of the draft causal LM, whatever its architecture (its own state, so its own names), with the
    embedding's (and an untied LM head's) rows = the target's vocabulary."""
    state = dict(model.state_dict())
    if _tied(model):
        state.pop("lm_head.weight", None)
    req: Shapes = {k: tuple(v.shape) for k, v in state.items()}
    emb = model.get_input_embeddings().weight
    req[_name_of(model, emb, state)] = (vocab, int(emb.shape[1]))
    if not _tied(model):
        out = model.get_output_embeddings().weight
        req[_name_of(model, out, state)] = (vocab, int(out.shape[1]))
    return {WEIGHTS: req}


def required(src: Source) -> dict[str, Shapes]:
    return required_for(hf_model(src.module), src.target_config.vocab_size)


def state_for(model: Any) -> dict[str, dict[str, torch.Tensor]]:
    state = dict(model.state_dict())
    if _tied(model):
        state.pop("lm_head.weight", None)
    return {WEIGHTS: contiguous(state)}


def tensors(src: Source) -> dict[str, dict[str, torch.Tensor]]:
    return state_for(hf_model(src.module))


def write_hf_dir(model: Any, tokenizer: Any, out: Path, weights: dict[str, dict[str, torch.Tensor]], meta: Any) -> None:
    """Write a plain HF causal-LM directory: weights, config.json (+ ``draftsmith`` block), tokenizer files."""
    save_file(weights[WEIGHTS], str(out / WEIGHTS), metadata={"format": "pt"})
    write_hf_config(model, tokenizer, out, meta)


def write_hf_config(model: Any, tokenizer: Any, out: Path, meta: Any) -> None:
    """The non-weight files of a plain HF causal-LM directory: config.json, generation config, tokenizer."""
    conf = clean_config(model.config, keep_version=True)
    conf["draftsmith"] = meta
    atomic_write_json(out / "config.json", conf)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(out)
    tokenizer.save_pretrained(out)


def write_config(src: Source, out: Path) -> None:
    write_hf_config(hf_model(src.module), src.target.tokenizer, out, src.provenance("hf"))


def load(directory: Path, target: Any) -> torch.nn.Module:
    """Import an exported HF draft as the standalone family's module (the family's own loader when it has one)."""
    from transformers import AutoModelForCausalLM

    try:
        spec = get("standalone")
    except Exception:  # the family module may not be written yet: the plain HF model is the drafter
        spec = None
    if spec is not None:
        meta = json.loads((directory / "config.json").read_text(encoding="utf-8"))
        saved = (meta.get("draftsmith") or {}).get("drafter") or {}
        return spec.load(str(directory), target.model, spec.config_cls(**saved) if saved else None)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=target.model.dtype).eval()


@torch.no_grad()
def probe(module: torch.nn.Module, target: Any) -> torch.Tensor:

    model = hf_model(module)
    ids = probe_ids(target.model.config.vocab_size).to(next(model.parameters()).device)
    return model(input_ids=ids).logits


register_format(
    Format(
        family="standalone",
        name="hf",
        doc="standalone draft model as a plain Hugging Face directory with the target's tokenizer",
        weights=WEIGHTS,
        keys=KeyMap(),
        tensors=tensors,
        required=required,
        write_config=write_config,
        load=load,
        probe=probe,
    )
)
