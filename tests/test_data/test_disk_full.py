"""A disk that fills during stage synth, for real: the run directory on a 40 KiB tmpfs.

The stage ends with one line (``error: ... disk full while writing <file> ...``, exit 2, no traceback), leaves
nothing half-written, and the same command, once there is room, finishes with exactly the rows of a run that never
hit the full disk. Needs root to mount the tmpfs (CI and the development machines run as root); skipped, saying
so, where the mount is refused.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from data.tiny_target import make_tiny_target
from tests import cli


def _rows(run: Path) -> list[tuple[str, list[int]]]:
    import pyarrow.parquet as pq

    rows = []
    for f in sorted((run / "data").glob("*.parquet")):
        rows += [(r["id"], r["input_ids"]) for r in pq.read_table(f, columns=["id", "input_ids"]).to_pylist()]
    return sorted(rows)


def test_synth_on_a_full_disk_ends_in_one_line_and_resumes_to_the_same_rows(
    tmp_path: Path, run_env: dict[str, str]
) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.decode()[:200]}")
    try:
        target = make_tiny_target("llama", tmp_path / "tiny-llama")
        args = ["stage=synth", "experiment=quickstart", "data.num_prompts=40", "synth.max_new_tokens=64"]
        args += ["target=hf", f"target.path={target}", "hydra.output_subdir=null"]

        def synth(run: Path) -> subprocess.CompletedProcess[str]:
            return cli.run([*args, f"hydra.run.dir={run}"], run_env, timeout=600)

        full = synth(disk / "run")
        assert full.returncode == 2, full.stderr[-3000:]
        assert "Traceback" not in full.stderr and "error: " in full.stderr and "disk full while writing" in full.stderr
        assert not list((disk / "run").rglob("*.tmp*")), list((disk / "run").rglob("*"))  # nothing half-written
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        again = synth(disk / "run")
        assert again.returncode == 0, again.stderr[-3000:]
        reference = synth(tmp_path / "reference")
        assert reference.returncode == 0, reference.stderr[-3000:]
        assert _rows(disk / "run") == _rows(tmp_path / "reference") and _rows(tmp_path / "reference")
    finally:  # lazily when still busy: a mount left behind keeps pytest from removing its temporary directories
        if subprocess.run(["umount", str(disk)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)
