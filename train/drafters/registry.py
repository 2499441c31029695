"""The drafter registry: one spec per drafter family; the training loop and the eval stage only use specs.

Adding a family means one new module that calls :func:`register` with a :class:`DrafterSpec`; the loop,
the decoder and the stages do not change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from train.config import ConfigError


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
    save: Callable[[torch.nn.Module, str, Any], None]
    """``save(drafter, directory, drafter_cfg)``: safetensors weights + config.json."""
    feature_layers: Callable[[Any, Any], list[int]] = lambda cfg, target_config: [target_config.num_hidden_layers]
    """Which target hidden states the loss reads (indices into HF ``hidden_states``); default: the last."""
    exporters: dict[str, Callable[..., Any]] = field(default_factory=dict)
    prepare: Callable[[torch.nn.Module, list[Any], Any], dict[str, Any]] | None = None
    """``prepare(drafter, rows, cfg) -> info``: data-dependent initialisation of a freshly built drafter from the
    training rows (``train.batches.Row``: ``input_ids``, ``loss_mask``), e.g. EAGLE-3's draft vocabulary. It
    must be deterministic (every process calls it) and keep what it derives in persistent buffers, so it is
    checkpointed and saved. ``info`` goes into the train manifest."""
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


BUILTIN = ("eagle", "eagle3", "medusa", "standalone")
"""Families that ship with the project: ``train/drafters/<name>.py``, each registering itself on import."""


def _load_builtin(name: str | None = None) -> None:
    import importlib

    for family in BUILTIN if name is None else [n for n in BUILTIN if n == name]:
        importlib.import_module(f"train.drafters.{family}")


def get(name: str) -> DrafterSpec:
    _load_builtin(name)
    if name not in _REGISTRY:
        raise ConfigError(f"Unknown drafter {name!r}; registered drafters: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def names() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)
