"""Checkpoint safety for ``resume=true``: nothing that could carry code is unpickled, a corrupt checkpoint is
skipped for the newest one that loads, and a changed config is continued only when the change is safe.

accelerate and DeepSpeed load some state files with ``torch.load(weights_only=False)`` (accelerate's
``custom_checkpoint_*.pkl``, DeepSpeed's engine files). Before any of that runs, every non-safetensors file of a
checkpoint is opened with ``torch.load(weights_only=True)`` (tensors, containers, numbers, and the few plain
types the RNG state needs). A pickle that passes that loader can only rebuild those allow-listed types, so the
later full load executes no other code; one that does not pass is refused, naming the file.
"""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path
from typing import Any

from safetensors import safe_open

from data.config import ConfigError, changed_keys, flat_config, is_safe_change, shown_value
from data.layout import TRAINER_STATE

logger = logging.getLogger(__name__)


class UnsafeCheckpointError(ConfigError):
    """A checkpoint file holds a pickle that would construct arbitrary objects (it could run code)."""


class CorruptCheckpointError(Exception):
    """A checkpoint file is missing, truncated or unreadable; the message names it and the cause."""


def _safe_globals() -> list[Any]:
    out: list[Any] = []
    try:
        from accelerate.utils.other import TORCH_SAFE_GLOBALS

        out.extend(TORCH_SAFE_GLOBALS)
    except ImportError:  # pragma: no cover - accelerate is a dependency
        pass
    try:  # plain-data types in DeepSpeed's own checkpoint files (ZeRO stage enum, loss scaler, fragment address)
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        out.extend([ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address])
    except ImportError:  # pragma: no cover
        pass
    return out


PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")
"""State files that accelerate or DeepSpeed unpickle; other files in a checkpoint (DeepSpeed's ``latest`` and
``zero_to_fp32.py``, JSON) are never unpickled and are not checked."""


def check_state_file(path: Path) -> None:
    """Open one torch/pickle state file with ``weights_only=True``; raise if it is unsafe or corrupt."""
    import torch

    try:
        with torch.serialization.safe_globals(_safe_globals()):
            torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "weights only" in str(exc).lower() or "weights_only" in str(exc).lower():
            # torch's message also advises re-running with weights_only=False: the unsafe action, never quoted
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and "weights_only" not in ln]
            cause = next((ln for ln in lines if "GLOBAL" in ln or "global" in ln), "")
            detail = f" ({cause[:200]})" if cause else ""
            raise UnsafeCheckpointError(
                f"refusing to load {path}: it holds pickled objects other than tensors and plain values, which "
                f"could run code when loaded{detail}. Delete that file (or the checkpoint) if you did not put it "
                "there; do not load it with weights_only=False."
            ) from None
        raise CorruptCheckpointError(f"{path}: unreadable ({exc})") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{path}: truncated or corrupt ({str(exc).splitlines()[0][:200]})") from None


def check_safetensors(path: Path) -> None:

    try:
        with safe_open(str(path), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                fh.get_slice(key)
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise CorruptCheckpointError(f"{path}: truncated or corrupt safetensors ({exc})") from None
    if path.stat().st_size < 8:
        raise CorruptCheckpointError(f"{path}: truncated (empty file)")


def verify_checkpoint(ckpt: Path) -> dict[str, Any]:
    """Check every file of ``ckpt`` (``state/``, ``drafter/``, ``trainer_state.json``); return the trainer state.

    Raises :class:`UnsafeCheckpointError` (refuse outright) or :class:`CorruptCheckpointError` (try an older one).
    """
    state_file = ckpt / TRAINER_STATE
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"{state_file}: unreadable ({exc})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CorruptCheckpointError(f"{state_file}: no step recorded")
    state_dir = ckpt / "state"
    if not state_dir.is_dir() or not any(state_dir.iterdir()):
        raise CorruptCheckpointError(f"{state_dir}: missing or empty")
    for f in sorted(p for p in state_dir.rglob("*") if p.is_file()):
        if f.suffix == ".safetensors":
            check_safetensors(f)
        elif f.suffix in PICKLE_SUFFIXES:
            check_state_file(f)
    for f in sorted((ckpt / "drafter").glob("*.safetensors")):
        check_safetensors(f)
    return state


def compare_resume_config(
    saved: dict[str, Any] | None, requested: dict[str, Any], where: Path, defaults: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The safe changes ``{key: [old, new]}`` between the run's saved config and the requested one; raises
    :class:`ConfigError` naming the other changed keys (they would make the resumed run another run).

    ``defaults`` (the schema's defaults, nested like ``requested``): a key the saved config lacks (added to the code
    after the checkpoint was written) counts as unchanged when it is requested at its schema default, because a new
    key's schema default is what the code did before the key existed."""
    if saved is None:
        logger.warning("%s records no config (an older checkpoint): cannot check the resumed config", where)
        return {}
    diff = changed_keys(saved, requested)
    if defaults is not None:
        flat_defaults = flat_config(defaults)
        added = [k for k, (a, b) in diff.items() if a == "<unset>" and k in flat_defaults and flat_defaults[k] == b]
        if added:
            logger.info("resume: keys newer than the checkpoint, at their defaults (the old behaviour): %s", added)
        diff = {k: v for k, v in diff.items() if k not in added}
    unsafe = {k: v for k, v in diff.items() if not is_safe_change(k)}
    if unsafe:
        shown = "; ".join(f"{k}: {shown_value(a)} -> {shown_value(b)}" for k, (a, b) in list(unsafe.items())[:10])
        raise ConfigError(
            f"resume=true with a changed config: {shown}. The run in {where.parent.parent} was made with the old "
            f"values; resuming with these would train a different run. Resume with the old values, or start a new "
            f"run (another run_name, or overwrite=true). Keys that may change on resume: max_steps, "
            f"stop_after_steps, save_every, eval_every, log_every, keep_checkpoints, wandb.*, runtime.*, slurm.*."
        )
    safe = {k: [a, b] for k, (a, b) in diff.items() if k not in ("resume", "overwrite", "stage", "target.device")}
    if safe:
        logger.warning("resume=true with changed settings (safe to change; recorded in the manifest): %s", safe)
    return safe


def check_drafter_dir(directory: str | Path, key: str) -> None:
    """A saved drafter directory is present and readable (config.json, intact safetensors): cheap, so the eval
    and export stages run it before the target loads. Raises :class:`ConfigError` naming the file and the fix."""
    path = Path(directory)
    conf = path / "config.json"
    if not path.is_dir():
        raise ConfigError(f"no drafter in {path} (directory missing): run stage=train for this run_name, or set {key}")
    try:
        meta = json.loads(conf.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"no drafter in {path} (no config.json): run stage=train first, or set {key}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{conf} is corrupt ({exc}); retrain, or set {key} to another checkpoint") from None
    if not isinstance(meta, dict) or not meta.get("draftsmith", {}).get("drafter"):
        raise ConfigError(f"{conf} does not say which drafter family it holds (draftsmith.drafter)")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise ConfigError(f"no weights (*.safetensors) in {path}: retrain, or set {key} to another checkpoint")
    for f in weights:
        try:
            check_safetensors(f)
        except CorruptCheckpointError as exc:
            raise ConfigError(
                f"{exc}. Hint: copy it again, or point {key} at another checkpoint (runs/<run>/train/checkpoints/"
                f"step-*/drafter)"
            ) from None
