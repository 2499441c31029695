"""Weights & Biases tracking: offline by default (no account needed), online with a key, or off.

Runs are named ``<run_name>-<stage>`` and grouped by ``run_name`` so a pipeline's stages sit together.
Offline runs land in ``<run_dir>/wandb/offline-run-*`` and can be uploaded later with ``wandb sync``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from train.config import ConfigError, WandbConfig

logger = logging.getLogger(__name__)
MODES = ("offline", "online", "disabled")


class Tracker:
    """A thin wrapper over one W&B run (a no-op when ``wandb.mode=disabled``)."""

    def __init__(
        self, cfg: WandbConfig, run_dir: Path, name: str, group: str, job_type: str, config: dict[str, Any]
    ) -> None:
        if cfg.mode not in MODES:
            raise ConfigError(f"wandb.mode={cfg.mode!r} is not one of {', '.join(MODES)}")
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

    @property
    def dir(self) -> str | None:
        return None if self.run is None else str(self.run.dir)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
