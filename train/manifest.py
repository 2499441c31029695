"""Run manifests: what a stage read, how it was configured, what it wrote, and how long it took."""

from __future__ import annotations

import dataclasses
import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from train.atomic import atomic_write_json


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
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run the stage that writes it first")
    return json.loads(path.read_text(encoding="utf-8"))
