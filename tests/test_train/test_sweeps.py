"""Local Hydra multirun sweeps (``python -m train -m ...``): several jobs in one process, one after another.

Job #1 of a training sweep used to die in accelerate's setup (``Default process group has not been initialized``):
the first job's end destroyed the process group while accelerate's process-wide state still said it was set up.
A tiny target keeps the jobs to seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from data.tiny_target import make_tiny_target
from tests import cli
from tests.conftest import REPO, TINY_SYNTH


def test_local_training_sweep_runs_every_job(tmp_path: Path, run_env: dict[str, str]) -> None:
    path = make_tiny_target("llama", tmp_path / "tiny-llama")
    base = [*TINY_SYNTH, "target=hf", f"target.path={path}", "drafter=eagle3", "drafter.draft_vocab_size=512"]
    synth = tmp_path / "synth"
    res = cli.run(["stage=synth", *base, f"hydra.run.dir={synth}"], run_env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    train = [f"synth_dir={synth}", "train.max_steps=2", "train.save_every=2", "train.eval_prompts=1"]
    train += ["train.eval_max_new_tokens=4", "train.features=online"]
    sweep = tmp_path / "sweep"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            "-m",
            "stage=train",
            *base,
            *train,
            "train.lr=1e-3,3e-4",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=REPO,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    manifests = sorted(sweep.glob("*/manifest.json"))
    assert len(manifests) == 2, list(sweep.iterdir())
    lrs = set()
    for m in manifests:
        data = json.loads(m.read_text())
        assert data["result"]["finished"] and data["result"]["steps"] == 2
        assert (m.parent / "best" / "model.safetensors").is_file()
        lrs.add(data["config"]["train"]["lr"])
    assert lrs == {1e-3, 3e-4}
