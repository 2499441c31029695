"""scripts/bench_scaling.py end to end at a tiny budget: two data volumes (train.max_rows) trained on one base run's
precomputed features, replayed on the same held-out prompts, with the CPU-time split, the paired comparison with
the reference row, the table and the plot."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, SMALL_SYNTH
from tests.derived import assert_tau_derived
from tests.test_train.runs import ok as _ok
from tests.test_train.runs import run_train as _run


def test_a_data_subset_is_drawn_from_every_part_of_the_data() -> None:
    """train.max_rows draws its rows at random (seeded): synth stores its sources one after another (the quarter of
    cpu_1h's 1,353 rows that came first held no HumanEval row), so the first N rows would change the mix."""
    from train.loop import subset_rows

    ids = subset_rows(1353, 338, 0)
    assert ids == sorted(set(ids)) and len(ids) == 338 and ids == subset_rows(1353, 338, 0)
    assert ids != subset_rows(1353, 338, 1)
    assert sum(i >= 1200 for i in ids) > 20  # the tail (where the HumanEval rows sit) is drawn too
    assert set(subset_rows(1353, 676, 0)) != set(range(676)) and subset_rows(5, 5, 0) == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_scaling_study_rows_share_prompts_and_split_cpu_time(
    synth_dir: Path, tmp_path: Path, run_env: dict[str, str]
) -> None:
    base = tmp_path / "base"
    shutil.copytree(synth_dir, base / "synth")
    _ok(_run([*SMALL_SYNTH, "stage=features", f"synth_dir={base / 'synth'}", f"hydra.run.dir={base / 'features'}",
              "wandb.mode=disabled"], run_env))  # fmt: skip
    overrides = [o for o in SMALL_SYNTH if not o.startswith("experiment=")]
    overrides += ["train.micro_batch_size=2", "train.warmup_steps=1", "train.save_every=2", "train.eval_every=0",
                  "train.log_every=1", "eval.num_prompts=2", "eval.max_new_tokens=8"]  # fmt: skip
    cmd = [sys.executable, str(REPO / "scripts" / "bench_scaling.py"), "--base", str(base), "--experiment",
           "quickstart", "--name", "sc", "--fractions", "0.5", "1", "--steps", "2", "--runs-root",
           str(tmp_path / "runs"), "--", *overrides]  # fmt: skip
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=1800, env=run_env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    study = json.loads((tmp_path / "runs" / "sc" / "scaling.json").read_text())
    half, full = study["rows"]
    assert (half["rows"], full["rows"]) == (6, 12) and study["base_rows"] == 12
    assert half["label"] == "rows6_steps2" and study["reference"] == full["label"]
    assert 0 < half["target_tokens"] < full["target_tokens"] == study["base_target_tokens"]
    # synth time is the base run's, scaled by the share of target-written tokens each row trains on
    base_synth = study["base_seconds"]["synth_seconds"]
    assert full["seconds"]["synth"] == pytest.approx(base_synth, abs=0.1)
    share = half["target_tokens"] / full["target_tokens"]
    assert half["seconds"]["synth"] == pytest.approx(base_synth * share, abs=0.1)
    assert half["seconds"]["features"] < full["seconds"]["features"] and half["seconds"]["train"] > 0
    for r in (half, full):
        assert r["steps"] == 2
        manifest = json.loads((Path(r["run_dir"]) / "train" / "manifest.json").read_text())
        assert manifest["result"]["train_rows"] == r["rows"]
        for kind in ("chain", "tree"):
            assert_tau_derived(r["tau"][kind]["all"])
    # the same held-out prompts judged every row: the paired comparison matches all of them
    ids = [r["tau"]["chain"]["all"]["per_prompt"]["ids"] for r in (half, full)]
    assert ids[0] == ids[1] and ids[0]
    assert half["paired_vs_reference"]["chain"]["prompts"] == len(ids[0])
    assert full["paired_vs_reference"] == {}
    md = (tmp_path / "runs" / "sc" / "scaling.md").read_text()
    assert "| rows6_steps2 |" in md and "reference" in md
    assert (tmp_path / "runs" / "sc" / "scaling.png").stat().st_size > 1000


def test_bench_memory_reports_a_step_on_the_longest_rows(synth_dir: Path) -> None:
    """scripts/bench_memory.py (BENCHMARKS' memory at 4k-token rows) on the small synth run: one EAGLE-3 step per
    micro-batch size on that many of the longest rows, padded to the longest; peak RSS only grows."""
    import pyarrow.parquet as pq

    lengths = sorted(
        len(r) for f in (synth_dir / "data").glob("*.parquet") for r in pq.read_table(f)["input_ids"].to_pylist()
    )
    cmd = [sys.executable, str(REPO / "scripts" / "bench_memory.py"), "--synth-dir", str(synth_dir)]
    res = subprocess.run(
        [*cmd, "--batch-sizes", "2", "1", "--threads", "1"], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(("micro-batch", f"{len(lengths)} rows"))]
    assert lines[0].startswith(f"{len(lengths)} rows, longest {lengths[-4:]}"), res.stdout
    assert [ln.split(" tokens")[0] for ln in lines[1:]] == [
        f"micro-batch 1 x {lengths[-1]}",
        f"micro-batch 2 x {lengths[-1]}",
    ]
    peaks = [float(x) for ln in lines for x in re.findall(r"peak RSS ([\d.]+) GiB", ln)]
    assert len(peaks) == 5 and peaks == sorted(peaks) and peaks[0] > 0.3, res.stdout  # the target alone is ~0.5 GiB
