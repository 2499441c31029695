"""launcher=slurm: submit stages as SLURM jobs from the templates in ``slurm/``.

``python -m train stage=<synth|train|eval|export|features|merge|all> launcher=slurm [overrides]`` composes the
config as usual, then, instead of running the stage:

1. makes a job directory ``runs/<run_name>/slurm/<stage>-<time>/`` with a snapshot of the code (``code/``:
   train/ data/ eval/ conf/ pyproject.toml; jobs import this copy, so later edits do not change queued jobs),
   the resolved config (``config.yaml``), the command-line overrides (``overrides.txt``) and ``logs/``;
2. fills the templates (``{{name}}`` placeholders) into ``*.sbatch`` scripts there;
3. submits them with ``sbatch`` (chained with ``--dependency=afterok``), prints the job ids and writes
   ``jobs.json``.

synth -> a job array (``slurm.array`` shards) then a merge job; train -> ``train_gpu.sbatch`` (one srun task
per node, torchrun per-GPU processes) or ``train_cpu.sbatch`` (``slurm.gpus_per_node=0``: srun tasks over
gloo), both requeueing themselves after a preemption signal; eval/export/features/merge -> ``stage.sbatch``;
all -> synth array -> merge -> (features) -> train -> eval.
"""

from __future__ import annotations

import logging
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from data.atomic import atomic_write_json, atomic_write_text
from data.config import ConfigError, bound_errors
from train.config import Config

logger = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parent.parent
TEMPLATES = REPO / "slurm"
CODE_PARTS = ("train", "data", "eval", "conf", "pyproject.toml")
SUBMITTABLE = ("synth", "merge", "features", "train", "eval", "export", "all")
LAUNCHERS = ("local", "slurm")
_DROP = re.compile(r"^(\+*)(launcher|slurm(\.[\w.]+)?|hydra\.run\.dir|hydra\.output_subdir|resume|stage)=")


def fill(template: str, values: dict[str, Any]) -> str:
    """Replace every ``{{name}}`` in ``template``; an unknown or unused placeholder is an error."""
    names = set(re.findall(r"\{\{(\w+)\}\}", template))
    missing = names - values.keys()
    if missing:
        raise KeyError(f"template placeholders without a value: {sorted(missing)}")
    return re.sub(r"\{\{(\w+)\}\}", lambda m: str(values[m.group(1)]), template)


def job_overrides(overrides: list[str]) -> list[str]:
    """The user's overrides minus the ones the job scripts set themselves (launcher, slurm.*, run dir, stage)."""
    return [o for o in overrides if not _DROP.match(o)]


def merge_overrides(overrides: list[str]) -> list[str]:
    """Later ``key=value`` overrides replace earlier ones of the same key (Hydra refuses duplicates)."""
    out: dict[str, str] = {}
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+")
        out.pop(key, None)
        out[key] = o
    return list(out.values())


def validate_slurm(cfg: Config) -> None:
    s = cfg.slurm
    errors = []
    if cfg.launcher not in LAUNCHERS:
        errors.append(f"launcher={cfg.launcher!r} must be one of {', '.join(LAUNCHERS)}")
    if cfg.stage not in SUBMITTABLE:
        errors.append(f"stage={cfg.stage} cannot be submitted; launcher=slurm takes {', '.join(SUBMITTABLE)}")
    errors += bound_errors(s, "slurm.")
    if not s.dry_run and shutil.which("sbatch") is None:
        errors.append("sbatch not found: run on a SLURM login node (or bash scripts/slurm_local.sh for a local one)")
    if errors:
        raise ConfigError("Invalid launcher=slurm config:\n  - " + "\n  - ".join(errors))


def snapshot_code(dest: Path) -> None:
    """Copy the code the jobs run (not outputs, caches or virtualenvs) into ``dest``."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    dest.mkdir(parents=True, exist_ok=True)
    for part in CODE_PARTS:
        src = REPO / part
        if src.is_dir():
            shutil.copytree(src, dest / part, ignore=ignore, dirs_exist_ok=True)
        elif src.is_file():
            shutil.copy2(src, dest / part)


def _sbatch_lines(cfg: Config, gpus: str | None) -> str:
    s = cfg.slurm
    lines = []
    if s.partition:
        lines.append(f"--partition={s.partition}")
    if s.account:
        lines.append(f"--account={s.account}")
    if s.mem:
        lines.append(f"--mem={s.mem}")
    if gpus:
        lines.append(gpus)
    lines += [e if e.startswith("-") else f"--{e}" for e in s.extra]
    return "\n".join(f"#SBATCH {line}" for line in lines)


class Submission:
    """The job directory of one ``launcher=slurm`` call, its scripts and the submitted job ids."""

    def __init__(self, cfg: Config, overrides: list[str]) -> None:
        self.cfg = cfg
        self.workdir = Path.cwd().resolve()
        self.base = (self.workdir / cfg.runs_root / cfg.run_name).resolve()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.dir = self.base / "slurm" / f"{cfg.stage}-{stamp}"
        n = 1
        while self.dir.exists():
            n += 1
            self.dir = self.base / "slurm" / f"{cfg.stage}-{stamp}-{n}"
        self.log_dir = self.dir / "logs"
        self.log_dir.mkdir(parents=True)
        self.code = self.dir / "code" if cfg.slurm.snapshot else REPO
        self.overrides = job_overrides(overrides)
        self.jobs: list[dict[str, Any]] = []

    def abs(self, path: str) -> Path:
        p = Path(path).expanduser()
        return p if p.is_absolute() else self.workdir / p

    def values(self, stage: str, run_dir: Path, extra: list[str] | None = None) -> dict[str, Any]:
        s = self.cfg.slurm
        gpu_stage = s.gpus_per_node > 0 and stage != "merge"
        ovs = merge_overrides([f"stage={stage}", *self.overrides, "launcher=local", *(extra or [])])
        if stage == "synth":  # the array sets the shard from SLURM_ARRAY_TASK_*
            ovs = [o for o in ovs if not o.startswith(("synth.num_shards=", "synth.shard_index="))]
        return {
            "job_name": f"{self.cfg.run_name}-{stage}",
            "stage": stage,
            "cpus_per_task": s.cpus_per_task,
            "time": s.time,
            "log_dir": self.log_dir,
            "sbatch_extra": _sbatch_lines(self.cfg, "--gpus=1" if gpu_stage else None),
            "setup": "\n".join(s.setup),
            "workdir": shlex.quote(str(self.workdir)),
            "code": shlex.quote(str(self.code)),
            "python": shlex.quote(s.python or sys.executable),
            "overrides": " ".join(shlex.quote(o) for o in ovs),
            "run_dir": shlex.quote(str(run_dir)),
        }

    def write(self, name: str, template: str, values: dict[str, Any]) -> Path:
        text = fill((TEMPLATES / template).read_text(encoding="utf-8"), values)
        path = self.dir / f"{name}.sbatch"
        atomic_write_text(path, text)
        path.chmod(0o755)
        return path

    def submit(self, name: str, script: Path, after: list[str] | None = None, **info: Any) -> str:
        cmd = ["sbatch", "--parsable"]
        if after:
            cmd.append("--dependency=afterok:" + ":".join(after))
        cmd.append(str(script))
        if self.cfg.slurm.dry_run:
            job_id = f"dry-run-{len(self.jobs) + 1}"
        else:
            res = subprocess.run(cmd, capture_output=True, text=True, cwd=self.workdir, timeout=60)
            if res.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip() or res.stdout.strip()}")
            job_id = res.stdout.strip().split(";")[0]
        self.jobs.append({"name": name, "id": job_id, "script": str(script), "after": after or [], **info})
        return job_id

    # -- stages --------------------------------------------------------------------------------------

    def synth(self, after: list[str] | None = None) -> list[str]:
        s = self.cfg.slurm
        synth_dir = self.abs(self.cfg.synth_dir)
        extra = [f"synth_dir={synth_dir}"]
        v = self.values("synth", synth_dir, extra)
        v |= {"last_index": s.array - 1, "array_parallel": f"%{s.array_parallel}" if s.array_parallel else ""}
        array_id = self.submit("synth", self.write("synth_array", "synth_array.sbatch", v), after, shards=s.array)
        merge = self.write("merge", "stage.sbatch", self.values("merge", synth_dir, extra))
        return [self.submit("merge", merge, [array_id], run_dir=str(synth_dir))]

    def single(self, stage: str, run_dir: Path, after: list[str] | None, extra: list[str] | None = None) -> list[str]:
        script = self.write(stage, "stage.sbatch", self.values(stage, run_dir, extra))
        return [self.submit(stage, script, after, run_dir=str(run_dir))]

    def train(self, after: list[str] | None = None, extra: list[str] | None = None) -> list[str]:
        s = self.cfg.slurm
        train_dir = self.abs(self.cfg.train_dir)
        v = self.values("train", train_dir, [f"train_dir={train_dir}", *(extra or [])])
        v |= {
            "nodes": s.nodes,
            "gpus_per_node": s.gpus_per_node,
            "tasks_per_node": s.tasks_per_node,
            "signal_grace": s.signal_grace,
            "max_requeues": s.max_requeues,
            "master_port": s.master_port,
            "resume": "true" if self.cfg.resume else "false",
            "sbatch_extra": _sbatch_lines(self.cfg, None),
        }
        template = "train_gpu.sbatch" if s.gpus_per_node > 0 else "train_cpu.sbatch"
        processes = s.nodes * (s.gpus_per_node or s.tasks_per_node)
        return [self.submit("train", self.write("train", template, v), after, processes=processes)]

    def run(self, run_dir: Path) -> dict[str, Any]:
        cfg = self.cfg
        if cfg.slurm.snapshot:
            snapshot_code(self.code)

        atomic_write_text(self.dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        atomic_write_text(self.dir / "overrides.txt", "\n".join(self.overrides) + "\n")
        stage = cfg.stage
        features_dir = self.abs(cfg.train.features_dir)
        if stage == "synth":
            self.synth()
        elif stage == "merge":
            self.single("merge", self.abs(cfg.synth_dir), None, [f"synth_dir={self.abs(cfg.synth_dir)}"])
        elif stage == "features":
            self.single("features", features_dir, None)
        elif stage == "train":
            self.train()
        elif stage in ("eval", "export"):
            self.single(stage, self.abs(str(run_dir)), None, [f"train_dir={self.abs(cfg.train_dir)}"])
        elif stage == "all":  # synth array -> merge -> (features) -> train -> eval, as stage=all does locally
            dirs = [f"synth_dir={self.abs(cfg.synth_dir)}", f"train_dir={self.abs(cfg.train_dir)}"]
            after = self.synth()
            if cfg.train.features == "precomputed":
                dirs.append(f"train.features_dir={features_dir}")
                after = self.single("features", features_dir, after, dirs)
            after = self.train(after, dirs)
            self.single("eval", self.base / "eval", after, dirs)
        out = {
            "stage": stage,
            "run_name": cfg.run_name,
            "job_dir": str(self.dir),
            "logs": str(self.log_dir),
            "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "dry_run": cfg.slurm.dry_run,
            "slurm": asdict(cfg.slurm),
            "jobs": self.jobs,
        }
        atomic_write_json(self.dir / "jobs.json", out)
        return out


def submit(cfg: Config, run_dir: Path, overrides: list[str]) -> dict[str, Any]:
    """Submit ``cfg.stage`` as SLURM job(s); print and return the job ids (also in ``jobs.json``)."""
    validate_slurm(cfg)
    result = Submission(cfg, overrides).run(run_dir)
    for job in result["jobs"]:
        dep = f" (after {', '.join(job['after'])})" if job["after"] else ""
        print(f"submitted {job['name']}: job {job['id']}{dep}  {job['script']}")
    print(f"jobs: {Path(result['job_dir']) / 'jobs.json'}   logs: {result['logs']}")
    return result
