"""Run manifests: what a stage read, how it was configured, what it wrote, and how long it took."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from data.atomic import atomic_write_json
from data.config import ConfigError, changed_keys, is_safe_change, shown_value
from data.layout import MANIFEST

logger = logging.getLogger(__name__)


def git_commit() -> str | None:
    """The code's git commit (with ``-dirty`` when there are uncommitted changes), or None."""
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("-dirty" if dirty else "")


def config_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg)


def write_manifest(path: Path, stage: str, cfg: Any, **sections: Any) -> dict[str, Any]:
    """Write ``manifest.json`` atomically and return it."""
    manifest: dict[str, Any] = {
        "stage": stage,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_commit": git_commit(),
        "host": platform.node(),
        "config": config_dict(cfg),
        **sections,
    }
    atomic_write_json(path, manifest)
    return manifest


def read_manifest(path: Path) -> dict[str, Any]:
    """A stage's manifest; a missing or unreadable one is a :class:`ConfigError`-style user error naming it."""

    if path.parent.is_file():
        raise ConfigError(f"{path.parent} is a file, not a stage output directory")
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run the stage that writes it first")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"{path} is corrupt (not valid JSON: {exc}); rerun the stage that writes it (overwrite=true)"
        ) from None
    if not isinstance(manifest, dict):
        raise ConfigError(f"{path} is corrupt (not a JSON object); rerun the stage that writes it (overwrite=true)")
    return manifest


STAGE_INPUTS: dict[str, tuple[str, ...]] = {
    "eval": (
        "seed",
        "synth_dir",
        "train_dir",
        "target.path",
        "target.gguf_file",
        "target.dtype",
        "target.trust_remote_code",
        "eval",
    ),
    "compare": ("runs",),
}
"""Per stage: the config keys (or key prefixes) its output depends on. Others (e.g. ``train.*`` for eval, whose
drafter comes from ``train_dir``) may differ between the run that wrote an output and the one that replaces it."""

_PATH_KEYS = ("synth_dir", "train_dir", "eval.drafter_dir", "eval.continuations_dir")


def check_same_config(run_dir: Path, stage: str, cfg: Any) -> None:
    """Refuse (``ConfigError``) to replace ``run_dir``'s output when it was made with another config, unless
    ``cfg.overwrite``; the message names the keys that differ."""

    path = run_dir / MANIFEST
    if not path.is_file():
        return
    try:
        old = read_manifest(path).get("config", {})
    except ConfigError:
        if cfg.overwrite:
            return
        raise
    new = config_dict(cfg)
    only = STAGE_INPUTS.get(stage)
    if stage == "eval" and getattr(getattr(cfg, "eval", None), "prompts", None) == "data":
        only = (*(only or ()), "data")
    for d in (old, new):  # the same directory spelt relative or absolute is the same input
        for key in _PATH_KEYS:
            head, _, tail = key.partition(".")
            holder = d.get(head) if tail else d
            leaf = tail or head
            if isinstance(holder, dict) and isinstance(holder.get(leaf), str):
                holder[leaf] = os.path.abspath(holder[leaf])
    # keys a stage names as its inputs always count (compare's runs=[...] is safe to change on a training resume)
    diff = {k: v for k, v in changed_keys(old, new, only).items() if not is_safe_change(k) or k in (only or ())}
    if not diff:
        return
    if cfg.overwrite:
        logger.warning(
            "overwrite=true: replacing %s output in %s made with another config (%s)", stage, run_dir, ", ".join(diff)
        )
        return
    shown = "; ".join(f"{k}: {shown_value(a)} -> {shown_value(b)}" for k, (a, b) in list(diff.items())[:8])
    raise ConfigError(
        f"{run_dir} holds {stage} output made with another config ({shown}). Add overwrite=true to replace it, "
        f"or write elsewhere (another run_name or hydra.run.dir)."
    )
