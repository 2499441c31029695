"""Outputs are atomic: a failed or interrupted write leaves the previous file intact and no partial file;
a full disk gives a clear error (checked on a real, tiny tmpfs when the machine lets us mount one)."""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from data.atomic import (
    DiskFullError,
    atomic_dir,
    atomic_write_json,
    atomic_write_text,
    atomic_write_with,
    sweep_unfinished,
)


def test_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    f = tmp_path / "out.json"
    atomic_write_json(f, {"v": 1})

    def broken(tmp: Path) -> None:
        tmp.write_text("partial")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        atomic_write_with(f, broken)
    assert f.read_text().strip().endswith("}") and '"v": 1' in f.read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_enospc_becomes_disk_full_error(tmp_path: Path) -> None:
    def full(tmp: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DiskFullError, match="disk full while writing"):
        atomic_write_with(tmp_path / "x.bin", full)
    assert not list(tmp_path.iterdir())


def test_atomic_dir_replaces_whole_directory(tmp_path: Path) -> None:
    d = tmp_path / "best"
    with atomic_dir(d) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(ValueError), atomic_dir(d) as tmp:
        (tmp / "a").write_text("2")
        raise ValueError("interrupted")
    assert (d / "a").read_text() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]


def test_sweep_after_a_kill_mid_commit_restores_or_removes_exactly_the_debris(tmp_path: Path) -> None:
    """The states a SIGKILL can leave inside atomic_dir / atomic_path / a checkpoint save: the previous output moved
    aside with its replacement not yet in place (put back), a temporary beside a complete output (removed). Other
    dot-files and outputs, and with ``names`` other outputs' debris, are left alone."""
    (tmp_path / ".best.old").mkdir()
    (tmp_path / ".best.old" / "w").write_text("previous")
    (tmp_path / ".best.ab12cd_3.tmp").mkdir()
    (tmp_path / ".manifest.json.x1y2z3w4.tmp").write_text("{")
    (tmp_path / "manifest.json").write_text("{}")
    (tmp_path / ".export.old").mkdir()
    (tmp_path / "export").mkdir()
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".lock").write_text("")
    ckpts = tmp_path / "checkpoints"
    (ckpts / ".step-000004.tmp" / "state").mkdir(parents=True)
    (ckpts / "step-000002").mkdir()

    assert sweep_unfinished(tmp_path, names=("export",)) == [tmp_path / ".export.old"]
    assert (tmp_path / ".best.old").exists()
    removed = sweep_unfinished(tmp_path)
    assert sorted(p.name for p in removed) == [".best.ab12cd_3.tmp", ".best.old", ".manifest.json.x1y2z3w4.tmp"]
    assert (tmp_path / "best" / "w").read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".hydra",
        ".lock",
        "best",
        "checkpoints",
        "export",
        "manifest.json",
    ]
    assert sweep_unfinished(ckpts) == [ckpts / ".step-000004.tmp"] and [p.name for p in ckpts.iterdir()] == [
        "step-000002"
    ]
    assert sweep_unfinished(tmp_path / "missing") == []


def test_real_full_disk(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root or no CAP_SYS_ADMIN)")
    try:
        atomic_write_text(mnt / "small.txt", "ok")
        with pytest.raises(DiskFullError, match="Free space"):
            atomic_write_text(mnt / "big.txt", "x" * 200_000)
        assert (mnt / "small.txt").read_text() == "ok"
        assert sorted(p.name for p in mnt.iterdir()) == ["small.txt"]
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_concurrent_target_conversions_convert_once(tmp_path: Path) -> None:
    """A process that finds another converting the GGUF waits for it and reuses its directory (it neither converts
    again nor replaces the directory under a reader). The GGUF here is not one: converting it would raise."""
    import fcntl
    import hashlib
    import threading

    from data.target import convert_gguf

    gguf = tmp_path / "model.Q4.gguf"
    gguf.write_bytes(b"not a gguf")
    out = tmp_path / "cache" / "targets" / f"model.Q4-{hashlib.sha256(b'not a gguf').hexdigest()[:16]}"
    out.parent.mkdir(parents=True)
    got: list[object] = []
    with open(out.parent / f".{out.name}.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # "another process" is converting
        waiter = threading.Thread(target=lambda: got.append(_call(convert_gguf, gguf, tmp_path / "cache")))
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive() and not got  # waits, does not convert alongside
        out.mkdir()
        (out / "config.json").write_text("{}")  # the other conversion finishes
    waiter.join(timeout=30)
    assert got == [out]


def _call(fn: Callable[..., object], *args: object) -> object:
    """``fn(*args)``, or the exception it raised (a thread's result)."""
    try:
        return fn(*args)
    except Exception as exc:
        return exc
