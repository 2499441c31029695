"""The drafter registry: one spec per drafter family; the training loop and the eval stage only use specs.

Adding a family means one new module that calls :func:`register` with a :class:`DrafterSpec`; the loop,
the decoder and the stages do not change.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from data.config import ConfigError
from eval.proposers.draft_model import check_vocab_compatibility
from train.drafters.saving import saved_config

if TYPE_CHECKING:
    from data.target import Target


@dataclass
class TrainBatch:
    """A padded micro-batch of synth rows (right padding)."""

    input_ids: torch.Tensor
    """``LongTensor[B, L]``."""
    attention_mask: torch.Tensor
    """``LongTensor[B, L]``: 1 for real tokens."""
    loss_mask: torch.Tensor
    """``LongTensor[B, L]``: 1 for target-written tokens (the synth loss mask)."""


@dataclass
class TargetFeatures:
    """What a frozen target forward gives a drafter's loss (computed online or read from the features stage)."""

    layers: dict[int, torch.Tensor]
    """HF ``hidden_states[i]`` for the layers the drafter asked for: ``[B, L, H]`` each; 0 = embeddings,
    ``num_hidden_layers`` = the final (post-norm) states, the LM head's input."""
    num_layers: int
    lm_head: torch.nn.Module
    """The target's (frozen) LM head."""

    @property
    def last(self) -> torch.Tensor:
        return self.layers[self.num_layers]


@dataclass(frozen=True)
class DrafterSpec:
    """Everything the pipeline needs to know about a drafter family."""

    name: str
    config_cls: type
    build: Callable[[Any, Any], torch.nn.Module]
    """``build(drafter_cfg, target_model) -> module``: a new, trainable drafter for this target."""
    loss: Callable[[torch.nn.Module, TrainBatch, TargetFeatures, Any], tuple[torch.Tensor, dict[str, torch.Tensor]]]
    """``loss(drafter, batch, features, cfg) -> (scalar loss, metrics)``; metrics are detached tensors."""
    proposer: Callable[[torch.nn.Module, Any, Any], Any]
    """``proposer(drafter, target_model, drafter_cfg) -> eval.proposers.base.Proposer``."""
    load: Callable[[str, Any, Any], torch.nn.Module]
    """``load(directory, target_model, drafter_cfg) -> module`` from a saved drafter directory."""
    save: Callable[[torch.nn.Module, str, Any, Any], None]
    """``save(drafter, directory, drafter_cfg, target)``: safetensors weights + config.json (``target``: the loaded
    ``data.target.Target``, for what a drafter ships beside its weights, e.g. the tokenizer; may be None).
    Head families use :func:`train.drafters.saving.save_head` / ``read_head`` / ``load_state``."""
    feature_layers: Callable[[Any, Any], list[int]] = lambda cfg, target_config: [target_config.num_hidden_layers]
    """Which target hidden states the loss reads (indices into HF ``hidden_states``); default: the last."""
    export_module: str | None = None
    """The module that registers this family's export formats (``train.export.core.register_format``), imported
    when an export is asked for; None: the family has no export format (stage export lists the valid pairs)."""
    prepare: Callable[[torch.nn.Module, list[Any], Any, Any], dict[str, Any]] | None = None
    """``prepare(drafter, rows, cfg, target_model) -> info``: data-dependent initialisation of a freshly built
    drafter from the training rows (``train.batches.Row``: ``input_ids``, ``loss_mask``), e.g. EAGLE-3's draft
    vocabulary. It must be deterministic (every process calls it) and keep what it derives in persistent
    buffers, so it is checkpointed and saved. ``info`` goes into the train manifest."""
    check: Callable[[Any, Any], None] | None = None
    """``check(cfg, target)`` with the loaded ``data.target.Target`` (model, tokenizer): refuse a config that
    cannot work with this target before anything is built (e.g. a draft model with another tokenizer)."""


_REGISTRY: dict[str, DrafterSpec] = {}


def register(spec: DrafterSpec) -> DrafterSpec:
    if spec.name in _REGISTRY:
        raise ValueError(f"drafter {spec.name!r} is registered twice")
    if not dataclasses.is_dataclass(spec.config_cls):
        raise TypeError(f"drafter {spec.name!r}: config_cls must be a dataclass")
    _REGISTRY[spec.name] = spec
    return spec


BUILTIN = ("eagle", "eagle3", "medusa", "standalone", "dflash")
"""Families that ship with the project: ``train/drafters/<name>.py``, each registering itself on import (its
:class:`DrafterSpec` carries the config dataclass, the training and decoding functions and its export module).
This tuple is the only list of families: the Hydra schemas, the CLI checks and the exporters read the registry.
A family outside the project registers itself with :func:`register` (one line) before the stages run."""


PLUGINS_ENV = "DRAFTSMITH_DRAFTERS"
"""Comma-separated modules holding drafter families of your own (each calls :func:`register` on import), e.g.
``DRAFTSMITH_DRAFTERS=mypkg.my_drafter``: ``drafter=<name>`` then selects it in every stage."""


def _load_builtin(name: str | None = None) -> None:
    for family in BUILTIN if name is None else [n for n in BUILTIN if n == name]:
        importlib.import_module(f"train.drafters.{family}")
    if name is None or name not in _REGISTRY:
        for module in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise ConfigError(f"{PLUGINS_ENV}: cannot import drafter module {module!r}: {exc}") from exc


def get(name: str) -> DrafterSpec:
    _load_builtin(name)
    if name not in _REGISTRY:
        raise ConfigError(f"Unknown drafter {name!r}; registered drafters: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def names() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def load_drafter(directory: str, target: Target) -> tuple[Any, torch.nn.Module, Any]:
    """Load a saved drafter directory: (spec, module, drafter config)."""
    path = Path(directory)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"No drafter checkpoint in {path}: run stage=train for this run_name first, or set eval.drafter_dir"
        )
    meta = json.loads((path / "config.json").read_text(encoding="utf-8")).get("draftsmith", {}).get("drafter")
    if not meta:
        raise ValueError(f"{path}/config.json does not say which drafter family it holds (draftsmith.drafter)")
    spec = get(meta["name"])
    dcfg = saved_config(spec.config_cls, meta)
    if (path / "tokenizer_config.json").is_file():  # a drafter that carries a tokenizer must carry the target's
        from transformers import AutoTokenizer

        vocab = target.model.config.vocab_size
        check_vocab_compatibility(vocab, vocab, target.tokenizer, AutoTokenizer.from_pretrained(str(path)))
    # on the target's device: every user (eval, export's probe, the vLLM parity check) feeds it the target's states
    module = spec.load(str(path), target.model, dcfg).to(target.device)
    return spec, module, dcfg
