"""The README's main command, shrunk: stage=all runs synth -> features -> train -> eval and prints the table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, SMALL_SYNTH
from tests.derived import assert_best_is_best_check

pytestmark = pytest.mark.slow


def test_stage_all_quickstart_shape(tmp_path: Path, run_env: dict[str, str]) -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            "stage=all",
            *SMALL_SYNTH,
            f"hydra.run.dir={tmp_path / 'all'}",
            "train.max_steps=4",
            "train.save_every=2",
            "train.eval_prompts=1",
            "train.eval_max_new_tokens=6",
            "eval.num_prompts=1",
            "eval.max_new_tokens=10",
        ],
        cwd=REPO,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for stage in ("synth", "features", "train", "eval"):
        manifest = json.loads((tmp_path / stage / "manifest.json").read_text())
        assert manifest["stage"] == stage and manifest["config"]["run_name"] == "quickstart"
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())["metrics"]
    assert {"plain", "eagle3_chain_k5", "eagle3_tree_n16", "prompt_lookup_k5"} == set(metrics)  # EAGLE-3, as the README
    assert all(m["identical_to_plain"] == 1.0 for per in metrics.values() for m in per.values())
    assert "| all | eagle3_tree_n16 |" in res.stderr + res.stdout
    train = json.loads((tmp_path / "train" / "manifest.json").read_text())
    assert train["result"]["finished"]
    assert_best_is_best_check(train)
    assert list((tmp_path / "train" / "wandb").glob("offline-run-*"))  # W&B offline by default
