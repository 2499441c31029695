"""One writer per run directory: a lock file held for the life of a stage.

The lock is ``<run_dir>/.lock``, created with ``O_CREAT | O_EXCL`` (atomic on local filesystems and on
NFSv3+/Lustre/GPFS, the shared filesystems SLURM clusters use), holding the holder's pid, host, start time
and command. A second writer finds the file and is refused with the holder's pid and host. A lock left by a
process that died (SIGKILL, OOM) is stale when its host is this host and its pid no longer runs, or when it
was taken by an earlier run of this same SLURM job (a requeue): it is removed and taken over. Any other lock
from another host is never judged stale here (we cannot see that host's processes): the message says which
file to delete once that job is gone. A stage that ends, fails or is stopped by a signal releases its lock.

Sharded synth runs (``synth.shard_index``, one SLURM array task per shard) lock ``.lock-shard-<i>`` so
the shards of one run work side by side, and refuse to start while an unsharded writer holds ``.lock``.
In multi-process training only rank 0 (``RANK`` / ``SLURM_PROCID``) takes the lock.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from data.config import ConfigError

logger = logging.getLogger(__name__)

LOCK_NAME = ".lock"


class RunLockedError(ConfigError):
    """Another live process holds the run directory's lock."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def read_holder(path: Path) -> dict[str, Any] | None:
    """The lock file's content, or None when it vanished; an unreadable file reads as ``{}``."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return holder if isinstance(holder, dict) else {}


def is_stale(holder: dict[str, Any]) -> bool:
    """A lock is stale when it was taken on this host by a process that no longer runs, or by an earlier run
    of this same SLURM job (a requeued job may start on another node; SLURM runs one instance of a job)."""
    pid = holder.get("pid")
    if holder.get("host") == socket.gethostname():
        return isinstance(pid, int) and pid != os.getpid() and not _pid_alive(pid)
    job = os.environ.get("SLURM_JOB_ID")
    return job is not None and holder.get("slurm_job_id") == job


EMPTY_LOCK_GRACE_S = 10.0
"""An empty or unreadable lock file older than this is stale: its writer died (or the disk filled) between
creating it and writing its holder, which takes microseconds; younger, it may still be being written."""


def stale(path: Path, holder: dict[str, Any]) -> bool:
    """:func:`is_stale`, and an empty or unreadable lock file older than :data:`EMPTY_LOCK_GRACE_S`."""
    if holder:
        return is_stale(holder)
    try:
        return time.time() - path.stat().st_mtime > EMPTY_LOCK_GRACE_S
    except FileNotFoundError:
        return True


def _describe(holder: dict[str, Any]) -> str:
    since = holder.get("time")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, int | float) else "?"
    return (
        f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} "
        f"(stage {holder.get('stage', '?')}, since {when})"
    )


def _is_rank_zero() -> bool:
    rank = os.environ.get("RANK")
    if rank is None and int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1:  # srun tasks without torchrun
        rank = os.environ.get("SLURM_PROCID")
    return rank in (None, "0")


class RunLock:
    """``with RunLock(run_dir, stage): ...`` holds ``run_dir/<name>`` for the block; see the module docstring."""

    def __init__(self, run_dir: str | os.PathLike[str], stage: str, name: str = LOCK_NAME) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / name
        self.stage = stage
        self.token = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
        self.held = False

    def _refuse(self, holder: dict[str, Any], path: Path) -> RunLockedError:
        return RunLockedError(
            f"{self.run_dir} is in use by {_describe(holder)}: two runs must not write one run directory. "
            f"Wait for it to finish, or use another run_name. If that process is gone (it ran on another host), "
            f"delete {path}."
        )

    def acquire(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.path.name != LOCK_NAME:  # a shard lock also respects the whole-directory lock
            main = self.run_dir / LOCK_NAME
            holder = read_holder(main)
            if holder is not None and not stale(main, holder):
                raise self._refuse(holder, main)
        else:  # the whole-directory lock waits for no shard, but refuses while a live shard task writes
            for shard in sorted(self.run_dir.glob(f"{LOCK_NAME}-shard-*")):
                holder = read_holder(shard)
                if holder is not None and not shard.name.count(".stale.") and not stale(shard, holder):
                    raise self._refuse(holder, shard)
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "time": time.time(),
            "stage": self.stage,
            "argv": sys.argv,
            "token": self.token,
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        }
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = read_holder(self.path)
                if holder is None:  # released between our open and our read: try again
                    continue
                if not stale(self.path, holder):
                    raise self._refuse(holder, self.path) from None
                what = _describe(holder) if holder else "an empty lock file (its writer died while creating it)"
                logger.warning("removing the stale lock %s of %s (no longer running)", self.path, what)
                # Rename first: of two processes removing the same stale lock only one rename succeeds.
                aside = self.path.with_name(f"{self.path.name}.stale.{os.getpid()}")
                with contextlib.suppress(FileNotFoundError):
                    os.replace(self.path, aside)
                    aside.unlink(missing_ok=True)
                continue
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as fh:
                    json.dump(info, fh)
                    fh.flush()
                    os.fsync(fh.fileno())
            except BaseException as exc:  # a lock that was never written must not outlive this attempt
                self.path.unlink(missing_ok=True)
                if isinstance(exc, OSError):
                    raise ConfigError(
                        f"cannot write the run lock {self.path}: {exc.strerror or exc}; free disk space (or fix the "
                        "directory's permissions) and rerun"
                    ) from exc
                raise
            self.held = True
            logger.debug("locked %s", self.path)
            return
        holder = read_holder(self.path) or {}
        raise self._refuse(holder, self.path)

    def release(self) -> None:
        if not self.held:
            return
        holder = read_holder(self.path)
        if holder is not None and holder.get("token") == self.token:
            self.path.unlink(missing_ok=True)
        self.held = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextlib.contextmanager
def run_lock(run_dir: str | os.PathLike[str], stage: str, shard: int | None = None) -> Iterator[RunLock | None]:
    """Hold the run directory's lock (rank 0 only; a shard lock for a sharded synth task)."""
    if not _is_rank_zero():
        yield None
        return
    lock = RunLock(run_dir, stage, LOCK_NAME if shard is None else f"{LOCK_NAME}-shard-{shard}")
    with lock:
        yield lock
