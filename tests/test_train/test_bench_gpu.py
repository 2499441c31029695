"""scripts/bench_gpu.py (the GPU check of every drafter family) at toy size on CPU: `--smoke` runs the same
plumbing (one synth run, each family trained by stage train, the manifest read back, FLOPs and MFU computed),
so the script cannot rot unnoticed on machines without a GPU. It says nothing about GPU speed."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_bench_gpu_smoke_trains_every_family(tmp_path: Path, run_env: dict[str, str]) -> None:
    cmd = [sys.executable, str(REPO / "scripts" / "bench_gpu.py"), "--smoke", "--runs-root", str(tmp_path)]
    cmd += ["--synth-engines", "hf,hf_generate"]  # the engine comparison's plumbing (vLLM's own test: test_synth_vllm)
    res = subprocess.run(cmd, cwd=REPO, env=run_env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_bench" / "bench_gpu.json").read_text())
    assert sorted(results) == ["eagle", "eagle3", "medusa", "standalone"]
    for family, r in results.items():
        assert r["steps"] == 3, family
        assert r["sequence_tokens_per_s"] > r["supervised_tokens_per_s"] > 0, family
        assert math.isfinite(r["mfu"]) and r["achieved_tflops"] >= 0, family  # rounded: tiny on a CPU
        assert r["best_tau"] >= 1.0, family
    synth = json.loads((tmp_path / "gpu_bench" / "bench_gpu_synth.json").read_text())
    assert synth["hf"]["engine"] == "hf" and synth["hf_generate"]["engine"] == "hf_generate"
    assert synth["hf_generate"]["rows_identical_to_hf"] == "16/16"  # greedy fp32: the same rows
