"""The one entry point: ``python -m train stage=<name> [overrides]``.

Stages are a dispatch table; each reads its inputs from configured paths, writes into its own run
directory (``runs/<run_name>/<stage>`` unless ``hydra.run.dir`` says otherwise) and a ``manifest.json``.
"""

from __future__ import annotations

import os

# Set before torch loads OpenMP: with few cores, spinning OpenMP workers slow batch-1 decoding a lot.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from train.config import Config, ConfigError, check_overrides, register_configs

logger = logging.getLogger("train")
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def _stage_synth(cfg: Config, run_dir: Path) -> Any:
    from data.synth import run_synth

    return run_synth(cfg, run_dir)


def _stage_merge(cfg: Config, run_dir: Path) -> Any:
    from data.synth import merge

    return merge(cfg, Path(cfg.synth_dir))


def _stage_features(cfg: Config, run_dir: Path) -> Any:
    from data.features import run_features

    return run_features(cfg, run_dir)


def _stage_train(cfg: Config, run_dir: Path) -> Any:
    from train.loop import run_train

    return run_train(cfg, run_dir)


def _stage_eval(cfg: Config, run_dir: Path) -> Any:
    from eval.run import run_eval

    return run_eval(cfg, run_dir)


def _stage_export(cfg: Config, run_dir: Path) -> Any:
    from train.export import run_export

    return run_export(cfg, run_dir)


def _stage_compare(cfg: Config, run_dir: Path) -> Any:
    from train.compare import run_compare

    return run_compare(cfg, run_dir)


def _stage_all(cfg: Config, run_dir: Path) -> Any:
    """synth -> (features) -> train -> eval. With the default run dir (runs/<run_name>/all) the stages write to
    runs/<run_name>/{synth,train,eval}, where the single-stage commands look for them."""
    base = run_dir.parent if run_dir.name == "all" else run_dir
    cfg.synth_dir, cfg.train_dir = str(base / "synth"), str(base / "train")
    logger.info("stage all: synth -> train -> eval under %s", base)
    _stage_synth(cfg, base / "synth")
    if cfg.train.features == "precomputed":
        cfg.train.features_dir = str(base / "features")
        _stage_features(cfg, base / "features")
    _stage_train(cfg, base / "train")
    return _stage_eval(cfg, base / "eval")


STAGES: dict[str, tuple[Callable[[Config, Path], Any], str]] = {
    "synth": (_stage_synth, "decode real prompts through the target into training data (+ held-out split)"),
    "features": (_stage_features, "precompute the target hidden states the drafter trains on (optional)"),
    "train": (_stage_train, "train the drafter (drafter=eagle) on the synth data with accelerate + DeepSpeed"),
    "eval": (_stage_eval, "held-out acceptance length and speedup of the drafter and its peers"),
    "export": (_stage_export, "write the trained drafter in a serving engine's format (export.format=...)"),
    "all": (_stage_all, "the whole pipeline: synth -> train -> eval"),
    "merge": (_stage_merge, "join the shards of a sharded synth run (SLURM array) and write its manifest"),
    "compare": (_stage_compare, "runs side by side (runs=[runs/a,runs/b]): tau per domain, speedup, tokens/s, budget"),
}


def config_groups() -> tuple[str, ...]:
    return tuple(sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir()))


def stage_help() -> str:
    return "Valid stages:\n" + "\n".join(f"  {name:<8} {doc}" for name, (_, doc) in STAGES.items())


def check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise ConfigError(f"Unknown stage {stage!r}. {stage_help()}")


def preflight(argv: list[str]) -> None:
    """Fail fast, before Hydra composes, on an unknown key or stage in the command line."""
    overrides = [a for a in argv if not a.startswith("-")]
    check_overrides(overrides, config_groups())
    for ov in overrides:
        if ov.startswith("stage="):
            for stage in ov.split("=", 1)[1].split(","):  # multirun: stage=synth,eval
                check_stage(stage)
        if ov.startswith("launcher="):
            from train.cluster import LAUNCHERS

            bad = [v for v in ov.split("=", 1)[1].split(",") if v not in LAUNCHERS]
            if bad:
                raise ConfigError(f"Unknown launcher {bad[0]!r}: valid launchers are {', '.join(LAUNCHERS)}")


def setup_runtime(cfg: Config) -> None:
    import torch

    for noisy in ("accelerate.checkpointing", "accelerate.accelerator", "httpx", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    threads = cfg.runtime.num_threads or os.cpu_count() or 1
    torch.set_num_threads(threads)


register_configs()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(dcfg: DictConfig) -> Any:
    from hydra.core.hydra_config import HydraConfig

    cfg: Config = OmegaConf.to_object(dcfg)  # type: ignore[assignment]
    try:
        check_stage(cfg.stage)
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        if cfg.launcher != "local":  # launcher=slurm: submit the stage as SLURM job(s) instead of running it here
            from train.cluster import submit

            return submit(cfg, run_dir, list(HydraConfig.get().overrides.task))
        setup_runtime(cfg)
        logger.info("stage %s -> %s", cfg.stage, run_dir)
        return STAGES[cfg.stage][0](cfg, run_dir)
    except ConfigError as exc:  # a bad value found once the config is composed: a message and exit 2, no traceback
        logger.error("%s", exc)
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


def cli() -> None:
    if "stage=help" in sys.argv[1:]:
        print(stage_help())
        return
    try:
        preflight(sys.argv[1:])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    main()


if __name__ == "__main__":
    cli()
