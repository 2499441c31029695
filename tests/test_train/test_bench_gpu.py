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

from tests import cli
from tests.conftest import REPO
from tests.derived import assert_best_is_best_check, assert_tau_derived

pytestmark = pytest.mark.slow


def test_bench_gpu_smoke_trains_every_family(tmp_path: Path, run_env: dict[str, str]) -> None:
    cmd = [sys.executable, str(REPO / "scripts" / "bench_gpu.py"), "--smoke", "--runs-root", str(tmp_path)]
    cmd += ["--synth-engines", "hf,hf_generate"]  # the engine comparison's plumbing (vLLM's own test: test_synth_vllm)
    res = subprocess.run(cmd, cwd=REPO, env=run_env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_bench" / "bench_gpu.json").read_text())
    assert sorted(results) == ["dflash", "eagle", "eagle3", "medusa", "standalone"]
    for family, r in results.items():
        assert r["steps"] == 3, family
        manifest = json.loads((tmp_path / f"gpu_bench_{family}" / "train" / "manifest.json").read_text())
        assert r["sequence_tokens_per_s"] == manifest["result"]["train_tokens_per_second"], family
        assert r["sequence_tokens_per_s"] > r["supervised_tokens_per_s"] > 0, family
        # MFU is the achieved rate over the peak given (989 TFLOP/s by default); both rounded, tiny on a CPU
        assert math.isfinite(r["mfu"]) and r["mfu"] == pytest.approx(r["achieved_tflops"] / 989.0, abs=1e-4), family
        assert r["best_tau"] == manifest["result"]["best"]["tau"], family
        assert_best_is_best_check(manifest)
    # (the quickstart's other stages on the CPU are test_pipeline's; the CUDA test below runs them on the GPU)
    synth = json.loads((tmp_path / "gpu_bench" / "bench_gpu_synth.json").read_text())
    assert synth["hf"]["engine"] == "hf" and synth["hf_generate"]["engine"] == "hf_generate"
    assert synth["hf_generate"]["rows_identical_to_hf"] == "16/16"  # greedy fp32: the same rows


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_bench_gpu_smoke_on_cuda_checks_every_family(tmp_path: Path, run_env: dict[str, str]) -> None:
    """The same toy run on the GPU in bf16 with DeepSpeed ZeRO-2: each family's in-training held-out check (run
    on the target's device) must finish; its first GPU run failed there with the drafter copy left on the CPU."""
    cmd = [sys.executable, str(REPO / "scripts" / "bench_gpu.py"), "--smoke", "--smoke-device", "cuda"]
    res = subprocess.run([*cmd, "--runs-root", str(tmp_path)], cwd=REPO, env=run_env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_bench" / "bench_gpu.json").read_text())
    assert sorted(results) == ["dflash", "eagle", "eagle3", "medusa", "standalone"]
    for family, r in results.items():
        assert r["steps"] == 3, family
        manifest = json.loads((tmp_path / f"gpu_bench_{family}" / "train" / "manifest.json").read_text())
        assert r["best_tau"] == manifest["result"]["best"]["tau"], family
        assert_best_is_best_check(manifest)
    _other_stages(tmp_path, run_env, "cuda")


def _other_stages(runs: Path, env: dict[str, str], device: str) -> None:
    """The quickstart's other stages with the target on ``device``, on the smoke's synth data: stage features,
    stage train on those precomputed features (the quickstart's way; the bench trains on online ones), then stage
    eval and stage export of the smoke's EAGLE-3 head (both load the head from disk, where it is built on the
    CPU, and run it on the target's hidden states)."""
    common = ["experiment=quickstart", f"runs_root={runs}", "run_name=gpu_bench_eagle3", "wandb.mode=disabled"]
    common += [f"target.device={device}", f"synth_dir={runs / 'gpu_bench' / 'synth'}", "data.max_prompt_tokens=200"]
    feats = runs / "gpu_bench_eagle3" / "features"
    pre = [f"train.features_dir={feats}", "train.features=precomputed", f"train_dir={runs / 'pre' / 'train'}"]
    pre += ["train.max_steps=2", "train.eval_prompts=1", "train.eval_max_new_tokens=4", "deepspeed=none"]
    stages = {
        "features": [],
        "train": pre,
        "eval": [
            "eval.num_prompts=1",
            "eval.max_new_tokens=8",
            "eval.decode_prompts=1",
            "eval.decode_max_new_tokens=8",
        ],
        "export": ["export=speculators"],
    }
    for stage, extra in stages.items():
        cmd = [f"stage={stage}", *common, *extra]
        if stage == "train":
            cmd.append(f"hydra.run.dir={runs / 'pre' / 'train'}")
        res = cli.run(cmd, env, timeout=900)
        assert res.returncode == 0, stage + ": " + res.stdout[-3000:] + res.stderr[-3000:]
    assert json.loads((runs / "pre" / "train" / "manifest.json").read_text())["result"]["steps"] == 2
    metrics = json.loads((runs / "gpu_bench_eagle3" / "eval" / "metrics.json").read_text())["metrics"]
    assert_tau_derived(metrics["eagle3_chain_k5"]["all"])
    assert metrics["eagle3_chain_k5"]["all"]["identical_to_plain"] == 1.0  # lossless with the head on the device
    manifest = json.loads((runs / "gpu_bench_eagle3" / "export" / "manifest-speculators.json").read_text())
    assert manifest["result"]["round_trip_max_abs_logit_diff"] <= 1e-3
