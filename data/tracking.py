"""Weights & Biases tracking: offline by default (no account needed), online with a key, or off.

Runs are named ``<run_name>-<stage>`` and grouped by ``run_name`` so a pipeline's stages sit together.
Offline runs land in ``<run_dir>/wandb/offline-run-*`` and can be uploaded later with ``wandb sync``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from data.config import ConfigError, WandbConfig

logger = logging.getLogger(__name__)


class Tracker:
    """A thin wrapper over one W&B run (a no-op when ``wandb.mode=disabled``)."""

    def __init__(
        self, cfg: WandbConfig, run_dir: Path, name: str, group: str, job_type: str, config: dict[str, Any]
    ) -> None:
        self.run: Any = None
        if cfg.mode == "disabled":
            return
        if cfg.mode == "online" and not os.environ.get("WANDB_API_KEY"):
            raise ConfigError("wandb.mode=online needs WANDB_API_KEY in the environment (or use wandb.mode=offline)")
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            mode=cfg.mode,
            dir=str(run_dir),
            name=name,
            group=group,
            job_type=job_type,
            config=config,
            reinit="finish_previous",
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)

    def summary(self, values: dict[str, Any]) -> None:
        if self.run is not None:
            for k, v in values.items():
                self.run.summary[k] = v

    def files(self, base: Path, files: dict[str, str]) -> None:
        """Record where a stage's outputs are (absolute paths, in the run summary under ``files/``)."""
        self.summary({f"files/{k}": str((base / v).resolve()) for k, v in files.items()})

    @property
    def dir(self) -> str | None:
        return None if self.run is None else str(self.run.dir)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a/b": 1}`` (numbers and strings only)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out |= flatten(v, key + "/")
        elif isinstance(v, int | float | str | bool) or v is None:
            out[key] = v
    return out


def log_stage(cfg: Any, run_dir: Path, stage: str, summary: dict[str, Any], files: dict[str, str]) -> None:
    """One W&B run for a stage that has no per-step metrics (synth, features): the resolved config, the
    stage's counts and timings as summary, and where its outputs are. Named ``<run_name>-<stage>``, grouped by
    ``run_name``; a W&B failure never fails the stage."""

    try:
        tracker = Tracker(cfg.wandb, run_dir, f"{cfg.run_name}-{stage}", cfg.run_name, stage, asdict(cfg))
    except ConfigError:
        raise
    except Exception as exc:  # wandb missing or broken: the stage's own outputs are what matter
        logger.warning("W&B logging of stage %s skipped: %s", stage, exc)
        return
    try:
        tracker.summary({k: v for k, v in flatten(summary).items() if v is not None})
        tracker.files(run_dir, files)
    finally:
        tracker.finish()
