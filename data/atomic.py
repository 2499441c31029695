"""Atomic file outputs: write to a temporary sibling, fsync, then rename.

A killed process or a full disk never leaves a half-written output under the final name: readers see
either the old file or the complete new one. A full disk raises :class:`DiskFullError` naming the path,
after removing the temporary file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_TEMP = re.compile(r"^\.(?P<name>.+?)\.(?:[A-Za-z0-9_]{8}\.tmp.*|tmp)$")


class DiskFullError(OSError):
    """Raised when an output cannot be written because the disk is full (nothing partial is left)."""

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno 28]"
        return str(self.strerror or super().__str__())


def raise_if_disk_full(exc: OSError, path: Path) -> None:
    """Raise :class:`DiskFullError` naming ``path`` when ``exc`` is a full disk or an exhausted quota."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        raise DiskFullError(
            exc.errno,
            f"disk full while writing {path}; nothing was left half-written. Free space (or point "
            f"runs_root / hydra.run.dir at a larger disk) and rerun the same command to resume (stage train: with "
            f"resume=true).",
        ) from exc


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed onto ``path``.

    The caller writes the temporary file (with any library). On error the temporary file is removed.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=f".tmp{suffix}", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    os.chmod(tmp, 0o644)
    try:
        yield tmp
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise_if_disk_full(exc, final)
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def atomic_write_with(path: str | os.PathLike[str], writer: Callable[[Path], None]) -> None:
    """Call ``writer(tmp_path)`` and rename the result onto ``path``."""
    with atomic_path(path, suffix=Path(path).suffix) as tmp:
        writer(tmp)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary directory beside ``path``; on success it replaces ``path`` in one rename."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    os.chmod(tmp, 0o755)
    try:
        yield tmp
        if final.exists():
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise_if_disk_full(exc, final)
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def sweep_unfinished(directory: str | os.PathLike[str], names: tuple[str, ...] | None = None) -> list[Path]:
    """Clean up after a writer killed mid-commit in ``directory`` (a SIGKILL, a node failure, the OOM killer).

    Removes the temporary siblings of :func:`atomic_path` / :func:`atomic_dir` (``.<name>.<random>.tmp``) and
    checkpoint saves (``.<name>.tmp``); a ``.<name>.old`` that :func:`atomic_dir` moved aside is put back when the
    kill came before its replacement took its place, else removed. ``names`` limits the sweep to those outputs.
    Call it only while holding the directory's run lock: a temporary file of a live writer would be removed too.
    Returns what it removed or restored.
    """
    root = Path(directory)
    if not root.is_dir():
        return []
    done: list[Path] = []
    for entry in sorted(root.iterdir()):
        if not entry.name.startswith("."):
            continue
        old = entry.name.endswith(".old") and len(entry.name) > 5
        name = entry.name[1:-4] if old else (m.group("name") if (m := _TEMP.match(entry.name)) else None)
        if name is None or (names is not None and name not in names):
            continue
        final = root / name
        if old and not final.exists():
            logger.warning("restoring %s: a replacement of it was interrupted", final)
            os.replace(entry, final)
        else:
            logger.warning("removing %s: a write of %s was interrupted", entry, final)
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        done.append(entry)
    return done
