"""Fault injection for ``python -m train`` in a subprocess: a full disk, a SIGKILL or a Ctrl-C at the N-th output
the stage commits.

Every output of every stage is written to a temporary name and committed with ``os.replace`` (``data/atomic.py``,
the training checkpoints), so the commits under the run's directory enumerate the stage's writes. The child
process wraps ``os.replace`` before the stage runs (:func:`install`, read from the environment):

- ``DRAFTSMITH_FAULT=count``: commit normally, append each commit's destination to ``DRAFTSMITH_FAULT_LOG``;
- ``enospc:KIND``: the first commit of this kind fails with ``ENOSPC`` as a full disk would (nothing is renamed);
- ``kill:KIND``: the process SIGKILLs itself right after the first commit of this kind (a node failure, the OOM
  killer);
- ``int:KIND``: the process gets SIGINT right after the first commit of this kind (Ctrl-C).

A commit's KIND is its path under the root with every number as N (:func:`kind_of`), e.g. ``data/chunk-N.parquet``.

Only commits whose destination lies under ``DRAFTSMITH_FAULT_ROOT`` count (the stage's own outputs, not a cache).
"""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
from pathlib import Path

from tests import cli


def install() -> None:
    mode = os.environ.get("DRAFTSMITH_FAULT", "")
    if not mode:
        return
    root = Path(os.environ["DRAFTSMITH_FAULT_ROOT"]).resolve()
    log = os.environ.get("DRAFTSMITH_FAULT_LOG")
    fault, _, at = mode.partition(":")
    real = os.replace

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        dest = Path(dst).resolve()
        if root not in dest.parents:
            real(src, dst, *args, **kwargs)  # type: ignore[arg-type]
            return
        rel = dest.relative_to(root).as_posix()
        if log:
            with open(log, "a", encoding="utf-8") as fh:
                fh.write(f"{rel}\n")
        hit = kind_of(rel) == at
        if fault == "enospc" and hit:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        real(src, dst, *args, **kwargs)  # type: ignore[arg-type]
        if fault == "kill" and hit:
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "int" and hit:
            os.kill(os.getpid(), signal.SIGINT)

    os.replace = replace  # type: ignore[assignment]


def run(
    args: list[str], env: dict[str, str], root: Path, fault: str = "", log: Path | None = None, timeout: int = 600
) -> subprocess.CompletedProcess[str]:
    """``python -m train *args`` with ``fault`` injected under ``root``."""
    env = dict(env, DRAFTSMITH_FAULT=fault, DRAFTSMITH_FAULT_ROOT=str(root))
    if log is not None:
        env["DRAFTSMITH_FAULT_LOG"] = str(log)
    return cli.run(args, env, timeout=timeout, prelude="tests.faults:install")


def kind_of(path: str) -> str:
    """A commit's kind: its path with every number as N (``data/chunk-N.parquet``, ``checkpoints/step-N``) and the
    random part of a temporary name left out (``.speculators.tmp/config.json``)."""
    return re.sub(r"\d+", "N", re.sub(r"\.[A-Za-z0-9_]{8}\.tmp(?=/|$)", ".tmp", path))


def write_kinds(commits: list[str]) -> list[str]:
    """The kinds of write a stage makes, in the order of their first commit."""
    return list(dict.fromkeys(kind_of(c) for c in commits))


def leftovers(root: Path) -> list[Path]:
    """Temporary outputs (``.<name>.<random>.tmp``, ``.step-N.tmp``) and outputs moved aside for a replacement
    (``.<name>.old``) left anywhere under ``root``."""
    return [p for p in root.rglob("*") if ".tmp" in p.name or (p.name.startswith(".") and p.name.endswith(".old"))]
