"""The one entry point: ``python -m train stage=<name> [overrides]``.

Stages are a dispatch table; each reads its inputs from configured paths, writes into its own run
directory (``runs/<run_name>/<stage>`` unless ``hydra.run.dir`` says otherwise) and a ``manifest.json``.
"""

from __future__ import annotations

import os

from data.layout import BEST, MANIFEST
from train.omp import set_default_wait

# Before torch loads OpenMP: threads spin briefly, then sleep (train/omp.py; OMP_WAIT_POLICY or GOMP_SPINCOUNT in the
# environment take precedence).
OMP_WAIT = set_default_wait()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# oneDNN (bf16 products on CPU) caches a primitive per distinct shape, 1,024 by default; training rows of every length
# make a new shape at nearly every step. 128 kept a 100-step bf16 cpu_1h probe at 8.6 GB peak instead of 10.9 at
# the same speed (the 1,800-step run with the default peaked at 21 GB); 0 halves the speed (BENCHMARKS).
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "128")

import gc
import importlib.resources
import logging
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from data.atomic import DiskFullError, sweep_unfinished
from data.config import ConfigError, TargetError, check_bounds
from data.manifest import check_same_config
from train.checkpoints import check_drafter_dir
from train.config import Config, check_overrides, check_run_name, register_configs
from train.runlock import run_lock

logger = logging.getLogger("train")
CONF_DIR = Path(str(importlib.resources.files("conf")))
"""The Hydra config tree, shipped as the ``conf`` package (package data): found the same way in a checkout, an
editable install and a wheel."""


# Every stage holds its run directory's lock (train/runlock.py) while it writes there: a second writer is
# refused with the holder's pid and host, so two runs can never mix their outputs.


def _stage_synth(cfg: Config, run_dir: Path) -> Any:
    from data.synth import run_synth

    with run_lock(run_dir, "synth", shard=cfg.synth.shard_index):
        return run_synth(cfg, run_dir)


def _stage_merge(cfg: Config, run_dir: Path) -> Any:
    from data.synth import merge

    with run_lock(Path(cfg.synth_dir), "merge"):
        return merge(cfg, Path(cfg.synth_dir))


def _check_synth_output(cfg: Config) -> None:
    """A finished synth output with a missing, damaged or replaced chunk or held-out split is refused before the
    target loads."""
    from data.synth_store import check_synth_output

    if (Path(cfg.synth_dir) / MANIFEST).is_file():
        check_synth_output(cfg.synth_dir)


def _stage_features(cfg: Config, run_dir: Path) -> Any:
    from train.features import run_features

    with run_lock(run_dir, "features"):
        _check_synth_output(cfg)
        return run_features(cfg, run_dir)


def _stage_train(cfg: Config, run_dir: Path) -> Any:
    from train.loop import run_train

    with run_lock(run_dir, "train"):
        _check_synth_output(cfg)
        return run_train(cfg, run_dir)


def check_drafter_fits(directory: str, cfg: Config, key: str) -> None:
    """Refuse, from the two config.json files and before the target's weights load, a drafter made for another
    target: every family shares the target's vocabulary, and the feature heads read its hidden size."""
    import json

    from data.target import resolve_target_path

    target_dir = Path(resolve_target_path(cfg.target))
    if not (target_dir / "config.json").is_file():  # a hub id: checked once it loads
        return
    tconf = json.loads((target_dir / "config.json").read_text(encoding="utf-8"))
    tconf = tconf.get("text_config") or tconf
    meta = json.loads((Path(directory) / "config.json").read_text(encoding="utf-8"))
    family = (meta.get("draftsmith") or {}).get("drafter", {}).get("name")
    dconf = meta.get("text_config") or meta
    checks = [("vocab_size", "vocabulary")] + ([("hidden_size", "hidden size")] if family != "standalone" else [])
    for k, what in checks:
        d, t = dconf.get(k), tconf.get(k)
        if d is not None and t is not None and int(d) != int(t):
            raise ConfigError(
                f"the drafter in {directory} was made for another target: its {what} is {d}, target "
                f"{cfg.target.path or cfg.target.name}'s is {t}. Point {key} at a drafter trained for this target, or "
                f"set target.path to the target it was trained for"
            )


def _stage_eval(cfg: Config, run_dir: Path) -> Any:
    from eval.run import run_eval

    with run_lock(run_dir, "eval"):
        sweep_unfinished(run_dir)  # what a killed eval left half-committed
        check_same_config(run_dir, "eval", cfg)  # never replace results made with another config silently
        if "drafter" in cfg.eval.proposers:  # a missing or corrupt drafter fails before the target loads
            check_drafter_dir(cfg.eval.drafter_dir or f"{cfg.train_dir}/{BEST}", "eval.drafter_dir")
            check_drafter_fits(cfg.eval.drafter_dir or f"{cfg.train_dir}/{BEST}", cfg, "eval.drafter_dir")
        if cfg.eval.prompts == "synth":  # so does a missing, truncated or empty held-out split
            from data.split import check_heldout_file

            check_heldout_file(cfg.synth_dir)
        elif cfg.eval.prompts != "data":  # a traffic file or glob
            from data.config import SourceConfig
            from data.sources import source_files

            source_files("eval", SourceConfig(kind="jsonl", paths=[cfg.eval.prompts]), key="eval.prompts")
        from train.drafters.registry import load_drafter

        return run_eval(cfg, run_dir, load_drafter=load_drafter)


def _stage_export(cfg: Config, run_dir: Path) -> Any:
    from train.export import run_export

    with run_lock(run_dir, "export"):
        if cfg.export.format is not None:  # without a format the stage lists the valid pairs
            check_drafter_dir(cfg.export.drafter_dir or f"{cfg.train_dir}/{BEST}", "export.drafter_dir")
            check_drafter_fits(cfg.export.drafter_dir or f"{cfg.train_dir}/{BEST}", cfg, "export.drafter_dir")
        return run_export(cfg, run_dir)


def _stage_deploy(cfg: Config, run_dir: Path) -> Any:
    from train.deploy import check_deploy_config, run_deploy

    check_deploy_config(cfg.deploy)  # a bad value fails before the target loads or an engine starts
    with run_lock(run_dir, "deploy"):
        sweep_unfinished(run_dir)
        check_drafter_dir(cfg.deploy.drafter_dir or f"{cfg.train_dir}/{BEST}", "deploy.drafter_dir")
        check_drafter_fits(cfg.deploy.drafter_dir or f"{cfg.train_dir}/{BEST}", cfg, "deploy.drafter_dir")
        return run_deploy(cfg, run_dir)


def _stage_compare(cfg: Config, run_dir: Path) -> Any:
    from train.compare import run_compare

    with run_lock(run_dir, "compare"):
        check_same_config(run_dir, "compare", cfg)  # another runs=[...] list never silently replaces a comparison
        return run_compare(cfg, run_dir)


def _stage_all(cfg: Config, run_dir: Path) -> Any:
    """synth -> (features) -> train -> eval. With the default run dir (runs/<run_name>/all) the stages write to
    runs/<run_name>/{synth,train,eval}, where the single-stage commands look for them."""
    from data.synth import validate_synth
    from eval.run import check_eval_config
    from train.loop import validate_train

    # every stage's settings are checked before the synth and features stages spend time
    validate_synth(cfg.synth)
    validate_train(cfg)
    check_eval_config(cfg.eval)
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
    "deploy": (_stage_deploy, "measure vLLM here and write the K-per-batch-size schedule that pays (vllm.json)"),
    "all": (_stage_all, "the whole pipeline: synth -> train -> eval"),
    "merge": (_stage_merge, "join the shards of a sharded synth run (SLURM array) and write its manifest"),
    "compare": (_stage_compare, "runs side by side (runs=[runs/a,runs/b]): tau per domain, speedup, tokens/s, budget"),
}


def config_groups() -> tuple[str, ...]:
    return tuple(sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir()))


def experiment_drafter(name: str) -> str | None:
    """The drafter family experiment ``name`` selects (``override /drafter: <family>`` in its defaults), or None
    (it selects none, or there is no such experiment: Hydra names the valid ones)."""
    path = CONF_DIR / "experiment" / f"{name}.yaml"
    if not path.is_file():
        return None
    for entry in OmegaConf.load(path).get("defaults", []) or []:
        if isinstance(entry, DictConfig):
            for key, value in entry.items():
                if str(key).split()[-1].lstrip("/") == "drafter" and value is not None:
                    return str(value)
    return None


def default_drafter(overrides: list[str]) -> str:
    """The family ``drafter.*`` overrides are checked against when no ``drafter=`` is given: the chosen
    experiment's drafter, else the root config's (eagle)."""
    exp = next((o.split("=", 1)[1] for o in overrides if o.startswith("experiment=")), None)
    return (experiment_drafter(exp) if exp and "," not in exp else None) or "eagle"


def stage_help() -> str:
    return "Valid stages:\n" + "\n".join(f"  {name:<8} {doc}" for name, (_, doc) in STAGES.items())


def check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise ConfigError(f"Unknown stage {stage!r}. {stage_help()}")


def compose_check(overrides: list[str]) -> None:
    """Compose the config as Hydra will (one run, not a sweep) and end what Hydra would report with exit 1 and a
    stack-trace hint -- a value of the wrong type (``train.lr=abc``), an unknown config group option
    (``drafter=foo``), a malformed override -- as a :class:`ConfigError` naming it."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    own = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            compose("config", overrides=own)
    except (HydraException, OmegaConfBaseException) as exc:
        noise = ("full_key:", "object_type=", "reference_type=", "msg:", "Set the environment variable")
        raw = str(exc).split("Config search path")[0]
        if exc.__cause__ is not None:  # e.g. "Value 'abc' of type 'str' could not be converted to Float"
            raw += "\n" + str(exc.__cause__)
        lines = [ln.strip() for ln in raw.splitlines() if ln.strip() and not ln.strip().startswith(noise)]
        lines = list(dict.fromkeys(lines))
        text = (lines[0] + (": " + ", ".join(lines[1:]) if len(lines) > 1 else "")) if lines else type(exc).__name__
        raise ConfigError(f"{text.replace(':,', ':')} (in the command-line overrides)") from None


def preflight(argv: list[str]) -> None:
    """Fail fast, before Hydra composes, on an unknown key or stage in the command line."""
    overrides = [a for a in argv if not a.startswith("-")]
    check_overrides(overrides, config_groups(), default_drafter(overrides))
    # one run with the project's own configs (a sweep, another config dir or name, --cfg/--info: Hydra's own)
    if not any(a.startswith("-") and a not in ("--debug",) for a in argv):
        compose_check(overrides)
    for ov in overrides:
        if ov.startswith("run_name="):
            for name in ov.split("=", 1)[1].split(","):
                check_run_name(name)
    for ov in overrides:
        if ov.startswith("stage="):
            for stage in ov.split("=", 1)[1].split(","):  # multirun: stage=synth,eval
                check_stage(stage)
        if ov.startswith("launcher="):
            from train.cluster import LAUNCHERS

            bad = [v for v in ov.split("=", 1)[1].split(",") if v not in LAUNCHERS]
            if bad:
                raise ConfigError(f"Unknown launcher {bad[0]!r}: valid launchers are {', '.join(LAUNCHERS)}")


def env_threads() -> int:
    """OMP_NUM_THREADS when it is set to a positive number (a SLURM job's --cpus-per-task, a shared machine's
    share), else 0."""
    try:
        return max(0, int(os.environ.get("OMP_NUM_THREADS", "0")))
    except ValueError:
        return 0


def setup_runtime(cfg: Config) -> None:
    import torch

    for noisy in ("accelerate.checkpointing", "accelerate.accelerator", "httpx", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    threads = cfg.runtime.num_threads or env_threads() or os.cpu_count() or 1
    torch.set_num_threads(threads)
    logger.debug("torch threads: %d; OpenMP wait: %s", threads, OMP_WAIT)
    if cfg.runtime.keep_freed_memory:
        keep_freed_memory()
    torch.backends.cuda.enable_cudnn_sdp(cfg.runtime.cudnn_sdpa)


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Large allocations from the heap, freed memory kept for reuse (``runtime.keep_freed_memory``); False where
    the C library is not glibc (nothing changes there)."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    ok = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    logger.debug("glibc malloc: large allocations from the heap, freed memory kept (%s)", ok)
    return ok


register_configs()


def debug_mode() -> bool:
    """``--debug`` or ``HYDRA_FULL_ERROR=1``: user errors show their traceback too."""
    return os.environ.get("DRAFTSMITH_DEBUG") == "1" or os.environ.get("HYDRA_FULL_ERROR") == "1"


USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError,
    TargetError,
    DiskFullError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
)
"""Errors that are the user's to fix (a bad value, a missing or corrupt input, a busy run directory): they end
with ``error: <message>`` and exit status 2, without a traceback (unless ``--debug``)."""


def to_config(dcfg: DictConfig) -> Config:
    """The typed config; a required value left unset (``???``) is a user error naming the key."""
    from omegaconf.errors import OmegaConfBaseException

    def missing_keys(node: DictConfig, prefix: str = "") -> list[str]:  # without resolving interpolations
        out: list[str] = []
        for key in node:
            child = node._get_node(key)
            if OmegaConf.is_missing(node, key):
                out.append(f"{prefix}{key}")
            elif isinstance(child, DictConfig):
                out.extend(missing_keys(child, f"{prefix}{key}."))
        return out

    missing = sorted(missing_keys(dcfg))
    if missing:
        hint = " (target=hf needs target.path=<a Hugging Face directory or hub id>)" if "target.path" in missing else ""
        raise ConfigError(f"required config value(s) not set: {', '.join(missing)}; add {missing[0]}=...{hint}")
    try:
        return OmegaConf.to_object(dcfg)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        # target=hf names the target after target.path (``name: ${.path}``); a "???" merged onto the schema's
        # default leaves path None, so the first thing to fail is that interpolation.
        if getattr(exc, "full_key", "") == "target.name" and dcfg.target._get_node("path")._value() is None:
            raise ConfigError(
                "target.path must be set: target=hf needs target.path=<a Hugging Face directory or hub id>"
            ) from None
        raise ConfigError(f"cannot resolve the config: {exc}") from None


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(dcfg: DictConfig) -> Any:
    from hydra.core.hydra_config import HydraConfig

    try:
        cfg = to_config(dcfg)
        check_bounds(cfg)  # every numeric key of every stage, before any stage does work
        check_run_name(cfg.run_name)
        check_stage(cfg.stage)
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        if cfg.launcher != "local":  # launcher=slurm: submit the stage as SLURM job(s) instead of running it here
            from train.cluster import submit

            return submit(cfg, run_dir, list(HydraConfig.get().overrides.task))
        setup_runtime(cfg)
        logger.info("stage %s -> %s", cfg.stage, run_dir)
        return STAGES[cfg.stage][0](cfg, run_dir)
    except USER_ERRORS as exc:  # found once the config is composed: a message and exit 2, no traceback
        if debug_mode():
            raise
        print_error(str(exc))
        logger.error("%s", exc)
        remove_scaffold(Path(HydraConfig.get().runtime.output_dir), Path(str(dcfg.get("runs_root", "runs"))))
        sys.exit(2)


def print_error(text: str) -> None:
    """``error: <text>`` on stderr, on a line of its own: progress bars still open are closed first (an error
    raised inside a loop would otherwise land at the end of its bar's line)."""
    try:
        from tqdm import tqdm

        for bar in list(getattr(tqdm, "_instances", ())):
            bar.close()
    except Exception:
        pass
    print(f"error: {text}", file=sys.stderr)


SCAFFOLD = {".hydra", "__main__.log"}
"""What Hydra writes into a run directory before the stage starts."""


def remove_scaffold(run_dir: Path, runs_root: Path | None = None) -> None:
    """Remove a run directory that holds nothing but Hydra's scaffold (a command that failed before writing
    anything leaves no empty run behind), and its run's directory (``<runs_root>/<run_name>``) when that is left
    empty; a directory with any output of a stage is kept whole."""
    try:
        if not run_dir.is_dir() or {p.name for p in run_dir.iterdir()} - SCAFFOLD:
            return
        shutil.rmtree(run_dir)
        parent = run_dir.parent
        if runs_root is not None and parent.resolve().parent == runs_root.resolve() and not any(parent.iterdir()):
            parent.rmdir()
    except OSError:
        pass  # tidying only


def cli() -> None:
    # Importing torch and transformers made millions of objects that live as long as the process: frozen out of the
    # garbage collector's sight, its full passes (several of them at exit) skip them. A refusal on a 2-core AVX2 CPU
    # went from 11.6-13.4 s to 7.3-9.5 s (BENCHMARKS, *The test suite*); a stage's own objects are collected as before.
    gc.freeze()
    if "--debug" in sys.argv[1:]:
        sys.argv.remove("--debug")
        os.environ["DRAFTSMITH_DEBUG"] = "1"
        os.environ["HYDRA_FULL_ERROR"] = "1"
    if "stage=help" in sys.argv[1:]:
        print(stage_help())
        return
    try:
        preflight(sys.argv[1:])
    except ConfigError as exc:
        if debug_mode():
            raise
        print_error(str(exc))
        sys.exit(2)
    try:
        main()
    except KeyboardInterrupt:
        if debug_mode():
            raise
        print_error(
            "interrupted; outputs are written atomically and training checkpoints at save_every steps: rerun "
            "the same command (train: resume=true) to go on"
        )
        sys.exit(130)


if __name__ == "__main__":
    cli()
