"""A drafter family of one's own: one module (tests/test_train/toy_family.py) with one registration line, named in
``DRAFTSMITH_DRAFTERS``; nothing else in the project changes. It trains (the real loop), decodes
losslessly in stage eval, and stage export refuses it with the list of valid (family, format) pairs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests import cli
from tests.conftest import SMALL_SYNTH
from tests.derived import assert_tau_derived
from tests.test_train.runs import losses


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return cli.run(args, env, timeout=900)


def test_a_family_of_ones_own_trains_decodes_and_is_refused_by_export(
    synth_dir: Path, tmp_path: Path, run_env: dict[str, str]
) -> None:
    env = {**run_env, "DRAFTSMITH_DRAFTERS": "tests.test_train.toy_family"}
    common = [*SMALL_SYNTH, f"synth_dir={synth_dir}", "drafter=toy", f"runs_root={tmp_path}", "run_name=toy"]
    train = [
        "stage=train",
        "train.features=online",
        "train.max_steps=6",
        "train.micro_batch_size=4",
        "train.lr=3e-2",
        "train.warmup_steps=1",
        "train.save_every=6",
        "train.eval_prompts=1",
        "train.eval_max_new_tokens=8",
        "train.log_every=1",
    ]
    res = _cli([*common, *train], env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = tmp_path / "toy" / "train"
    got = losses(run)
    assert len(got) == 6 and got[-1] < got[0], got  # it learns
    meta = json.loads((run / "best" / "config.json").read_text())
    assert meta["draftsmith"]["drafter"]["name"] == "toy"

    ev = [
        "stage=eval",
        "eval.proposers=[drafter]",
        "eval.decode=chain",
        "eval.num_prompts=2",
        "eval.max_new_tokens=16",
        "eval.decode_prompts=1",
        "eval.decode_max_new_tokens=16",
    ]
    res = _cli([*common, *ev], env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    metrics = json.loads((tmp_path / "toy" / "eval" / "metrics.json").read_text())
    toy = metrics["metrics"]["toy_chain_k5"]["all"]  # eval.k=5 sets the chain length
    assert toy["identical_to_plain"] == 1.0 and toy["decode_prompts"] == 2, toy
    assert_tau_derived(toy)

    res = _cli([*common, "stage=export", "export.format=hf"], env)
    assert res.returncode != 0
    out = res.stdout + res.stderr
    assert "No exporter for drafter 'toy'" in out and "drafter=toy: no export format" in out, out[-2000:]
    assert "drafter=eagle3 export.format=speculators" in out

    # Without the plugin the name is unknown, with the valid choices listed (no traceback).
    res = _cli([*common, *train], run_env)
    assert res.returncode != 0 and "toy" in res.stdout + res.stderr and "Traceback" not in res.stderr
