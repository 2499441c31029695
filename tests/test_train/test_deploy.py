"""stage deploy refuses what it cannot measure before it loads a model or starts an engine. (The stage itself, on
a trained head in vLLM: tests/test_export/test_vllm_parity.py::check_deploy.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, subprocess_env


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "train", "stage=deploy", f"runs_root={tmp_path}", *args]
    return subprocess.run(cmd, cwd=REPO, env=subprocess_env("disabled"), capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["deploy.calibrate_k=[9]"], "deploy.calibrate_k=[9]: give one or more K in 1..deploy.k_max=5"),
        (["deploy.batch_sizes=[1,512]"], "deploy.batch_sizes go up to 512 > deploy.max_batch=256"),
        (["deploy.acceptance=replay"], "deploy.acceptance='replay' is not one of: auto, eval, engine"),
        (["deploy.min_gain=0.9"], "deploy.min_gain=0.9 must be >= 1"),
        ([], "deploy.drafter_dir"),  # no trained drafter in this run: named, with what makes one
        (["deploy.drafter_dir=/nonexistent/best"], "/nonexistent/best"),
    ],
)
def test_deploy_refuses_before_work(tmp_path: Path, args: list[str], needle: str) -> None:
    res = _cli(tmp_path, *args)
    assert res.returncode == 2, res.stderr[-2000:]
    assert needle in res.stderr and "Traceback" not in res.stderr + res.stdout
    assert not list(tmp_path.rglob("vllm.json")) and not list(tmp_path.rglob("deploy.json"))
