"""A drafter directory on disk, shared by the head families: ``config.json`` + ``model.safetensors``.

``config.json`` holds the head's own sizes (a family writes what its engine layout expects) and a
``draftsmith`` block: the drafter config the head was trained with (``draftsmith.drafter``) and whatever the
family records beside it (EAGLE-3: its layer ids and the hash of its vocabulary map). Weights are safetensors
only. Loading checks the head's hidden and vocabulary sizes against the target before any tensor is read, and
refuses a state dict with missing or unexpected tensors (tensors a module rebuilds itself, such as a rotary
cache, are never saved and never required).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import extract_model_from_parallel
from safetensors.torch import load_file, save_file

from data.atomic import atomic_write_json

WEIGHTS = "model.safetensors"
DERIVED = ("rotary.",)
"""State-dict prefixes a module rebuilds on construction: not saved, not required on load."""


def save_head(
    module: torch.nn.Module,
    directory: str | Path,
    cfg: Any,
    config: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
    skip: tuple[str, ...] = (),
) -> None:
    """Write ``module``'s weights (without :data:`DERIVED` and ``skip`` prefixes) and ``config`` + the
    ``draftsmith`` block (``drafter``: ``cfg``; then ``extra``) into ``directory``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model = extract_model_from_parallel(module)
    leave = DERIVED + skip
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if not k.startswith(leave)}
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt", "drafter": str(cfg.name)})
    atomic_write_json(out / "config.json", {**config, "draftsmith": {"drafter": asdict(cfg), **(extra or {})}})


@dataclass
class SavedHead:
    """A saved head as read back: its ``config.json``, the drafter config it was trained with, its tensors."""

    path: Path
    meta: dict[str, Any]
    cfg: Any
    state: dict[str, torch.Tensor]

    @property
    def recorded(self) -> dict[str, Any]:
        """The ``draftsmith`` block of its ``config.json``."""
        return dict(self.meta.get("draftsmith") or {})


def saved_config(config_cls: type, saved: Mapping[str, Any]) -> Any:
    """The drafter config a saved head was trained with: its saved keys, and for a key it lacks (a head saved before
    the key existed) what the code did then (the family's ``absent_means``), not today's default."""
    return config_cls(**{**getattr(config_cls, "absent_means", {}), **saved})


def read_head(directory: str | Path, config_cls: type, target_config: Any, what: str) -> SavedHead:
    """Read a saved head; refuse one trained for a target of another hidden or vocabulary size."""
    path = Path(directory)
    meta = json.loads((path / "config.json").read_text(encoding="utf-8"))
    hidden, vocab = meta.get("hidden_size"), meta.get("vocab_size")
    if hidden != target_config.hidden_size or vocab != target_config.vocab_size:
        raise ValueError(
            f"{what} in {path} was trained for hidden_size={hidden}, vocab_size={vocab}; this target has "
            f"{target_config.hidden_size}, {target_config.vocab_size}"
        )
    cfg = saved_config(config_cls, (meta.get("draftsmith") or {}).get("drafter") or {})
    return SavedHead(path, meta, cfg, read_weights(path))


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a saved drafter directory (no size checks: :func:`read_head` does those)."""
    return load_file(str(Path(directory) / WEIGHTS))


def load_state(module: torch.nn.Module, state: Mapping[str, torch.Tensor], where: str) -> None:
    """Load ``state`` into ``module``; refuse missing (other than :data:`DERIVED`) or unexpected tensors."""
    missing, unexpected = module.load_state_dict(dict(state), strict=False)
    missing = [k for k in missing if not k.startswith(DERIVED)]
    if missing or unexpected:
        raise ValueError(f"{where}: missing {missing}, unexpected {unexpected}")
