"""The layout of a run directory: every file and folder name a stage writes or reads, in one place.

A run is ``<runs_root>/<run_name>/`` with one directory per stage (their defaults are in the config:
``synth_dir``, ``train_dir``, ``eval.out_dir``, ...)::

    synth/    manifest.json  heldout.jsonl  data/chunk-00000.parquet  stats/chunk-00000.json
              replay/        (the target's continuations and traces, cached for replay)
    train/    manifest.json  best/  checkpoints/step-000100/{state/, drafter/, trainer_state.json}
              stopped.json   (left by a preempted job for its requeue)
    eval/     manifest.json  metrics.json  table.md  acceptance.png  replay/
    export/<format>/         (what a serving engine loads)

Stages, the comparison and the scripts name these paths through this module, never as string literals.
"""

from __future__ import annotations

from pathlib import Path

MANIFEST = "manifest.json"
"""Every stage's record of what it did (config, inputs, counts, result): written last, so its presence means done."""

# synth
HELDOUT = "heldout.jsonl"
SYNTH_DATA = "data"
SYNTH_STATS = "stats"
CHUNK_GLOB = "chunk-*.parquet"
REPLAY = "replay"
"""Replay's caches (continuations, traces) beside the held-out split they were made for."""

# train
BEST = "best"
CHECKPOINTS = "checkpoints"
STEP_GLOB = "step-*"
TRAINER_STATE = "trainer_state.json"
CHECKPOINT_STATE = "state"
"""accelerate/DeepSpeed state (weights, optimizer, scheduler, RNG) inside a checkpoint."""
CHECKPOINT_DRAFTER = "drafter"
"""The drafter's safetensors inside a checkpoint (what ``best/`` is copied from)."""
STOPPED = "stopped.json"

# eval
METRICS = "metrics.json"
TABLE = "table.md"
PLOT = "acceptance.png"

# export
EXPORT = "export"


def chunk_path(synth_dir: str | Path, idx: int) -> Path:
    """The synth chunk ``idx``'s rows."""
    return Path(synth_dir) / SYNTH_DATA / f"chunk-{idx:05d}.parquet"


def chunk_stats_path(synth_dir: str | Path, idx: int) -> Path:
    """The synth chunk ``idx``'s counters (written with it)."""
    return Path(synth_dir) / SYNTH_STATS / f"chunk-{idx:05d}.json"


def heldout_path(synth_dir: str | Path) -> Path:
    return Path(synth_dir) / HELDOUT


def manifest_path(stage_dir: str | Path) -> Path:
    return Path(stage_dir) / MANIFEST


def step_name(step: int) -> str:
    """A checkpoint's directory name (zero-padded, so that names sort by step)."""
    return f"step-{step:06d}"


def export_dir(runs_root: str | Path, run_name: str, fmt: str) -> Path:
    """Where stage export writes format ``fmt`` by default."""
    return Path(runs_root) / run_name / EXPORT / fmt
