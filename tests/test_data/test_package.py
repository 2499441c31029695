"""A non-editable install works: the wheel carries every package and the Hydra config tree, and the installed
entry point runs a stage from outside the checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_wheel_installs_into_a_fresh_venv_and_runs_outside_the_checkout(tmp_path: Path) -> None:
    src = tmp_path / "src"  # build from a copy: the build writes build/ and *.egg-info next to the sources
    (src / "x").parent.mkdir(parents=True, exist_ok=True)
    for name in ("pyproject.toml", "README.md", "train", "data", "eval", "conf"):
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy2
        copy(
            REPO / name,
            src / name,
            **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}),
        )
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(src)],
        check=True,
        timeout=600,
    )
    (wheel,) = wheels.glob("draftsmith-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in (
        "train/drafters/eagle3.py",
        "train/drafters/__init__.py",
        "train/export/core.py",
        "eval/proposers/feature_head.py",
        "eval/replay.py",
        "data/synth.py",
        "conf/config.yaml",
        "conf/drafter/eagle3.yaml",
        "conf/experiment/quickstart.yaml",
        "conf/hydra/launcher/slurm_local.yaml",
    ):
        assert needed in names, needed
    # A fresh venv that borrows only the third-party packages (torch etc.) from this interpreter.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    py = str(venv / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, timeout=600)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["WANDB_MODE"] = "disabled"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([py, *args], cwd=work, env=env, capture_output=True, text=True, timeout=900)

    where = run("-c", "import conf, train; print(conf.__file__); print(train.__file__)")
    assert where.returncode == 0, where.stderr
    assert all(line.startswith(str(venv)) for line in where.stdout.split()), where.stdout  # the wheel's copies
    help_ = run("-m", "train", "stage=help")
    assert help_.returncode == 0 and "synth" in help_.stdout + help_.stderr
    synth = run(
        "-m",
        "train",
        "stage=synth",
        "data=humaneval",
        "data.num_prompts=2",
        "data.max_heldout=1",
        "synth.max_new_tokens=4",
        "hydra.run.dir=out",
    )
    assert synth.returncode == 0, synth.stdout[-2000:] + synth.stderr[-2000:]
    manifest = json.loads((work / "out" / "manifest.json").read_text())
    assert manifest["stage"] == "synth" and manifest["counts"]["conversations"] == 2
