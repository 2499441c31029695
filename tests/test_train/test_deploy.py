"""stage deploy refuses what it cannot measure before it loads a model or starts an engine. (The stage itself, on
a trained head in vLLM: tests/test_export/test_vllm_parity.py::check_deploy.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import cli
from tests.conftest import subprocess_env


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return cli.run(["stage=deploy", f"runs_root={tmp_path}", *args], subprocess_env("disabled"), timeout=300)


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


def test_acceptance_and_allowed_k_from_the_run(tmp_path: Path) -> None:
    """The schedule is chosen for the family's longest replayed chain, per source; the K a family can be served with."""
    import json
    import math
    from types import SimpleNamespace

    from train.deploy import allowed_ks, read_acceptance

    metrics = {
        "plain": {"all": {"alpha": []}},
        "eagle3_chain_k3": {"all": {"alpha": [0.5, 0.4, 0.3]}},
        "eagle3_chain_k10": {"all": {"alpha": [0.6] * 10, "tau_from": "replay"}, "code": {"alpha": [0.7, math.nan]}},
        "eagle3_tree_n16": {"all": {"alpha": [0.9, 0.9]}},
        "prompt_lookup_k5": {"all": {"alpha": [0.1] * 5}},
    }
    (tmp_path / "metrics.json").write_text(json.dumps({"metrics": metrics}))
    alpha, how = read_acceptance(str(tmp_path), "eagle3")
    assert alpha == {"all": [0.6] * 10, "code": [0.7, 0.0]} and how.startswith("replay (eagle3_chain_k10")
    assert read_acceptance(str(tmp_path), "medusa") is None  # no chain of this family was judged
    assert read_acceptance(str(tmp_path / "missing"), "eagle3") is None and read_acceptance(None, "eagle3") is None
    assert allowed_ks("eagle3", None, 5) == [1, 2, 3, 4, 5]
    assert allowed_ks("medusa", SimpleNamespace(num_heads=3), 5) == [1, 2, 3]
    assert allowed_ks("dflash", SimpleNamespace(block_size=8), 5) == [7]  # its block's own length, only


def test_deploy_without_an_engine_is_one_error_line(tmp_path: Path, target) -> None:
    """A Python that cannot import vLLM (named by deploy.vllm_python) is refused with the fix, exit 2, before the
    target loads."""
    from train.drafters.eagle import EagleConfig, build, save

    save(build(EagleConfig(), target.model), str(tmp_path / "r" / "train" / "best"), EagleConfig())
    res = _cli(tmp_path, "run_name=r", f"deploy.vllm_python={sys.executable}")
    assert res.returncode == 2, res.stderr[-2000:]
    assert "cannot import vllm" in res.stderr and "Traceback" not in res.stderr + res.stdout
    assert not (tmp_path / "r" / "deploy" / "deploy.json").exists()
