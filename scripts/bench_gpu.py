"""GPU check for stage train: the EAGLE head for a few hundred steps in bf16 with DeepSpeed ZeRO-2 on one
GPU, then tokens/s and model FLOP utilisation (MFU). Sized to finish in under 8 minutes on one H200.

    python3 scripts/bench_gpu.py [--steps 300] [--peak-tflops 989]

MFU counts the useful FLOPs per training step: the frozen target forward (2 N_target per sequence token,
online features), the head's forward and backward (6 N_head per sequence token) and the LM-head
cross-entropy on supervised tokens (target logits 2 H V, draft logits forward + backward 6 H V).
Peak: dense bf16 of an H100/H200 SXM (989 TFLOP/s). Not run in CI (needs CUDA).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--run-name", default="gpu_bench")
    args = ap.parse_args()
    common = ["experiment=quickstart", f"run_name={args.run_name}", "wandb.mode=disabled"]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            "stage=synth",
            *common,
            "data.num_prompts=512",
            "synth.batch_size=128",
            "synth.chunk_size=512",
            "synth.max_new_tokens=256",
        ],
        cwd=REPO,
        check=True,
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            "stage=train",
            *common,
            "overwrite=true",
            "train.features=online",
            "train.dtype=bfloat16",
            f"train.max_steps={args.steps}",
            "train.micro_batch_size=16",
            "train.save_every=100000",
            "train.eval_prompts=4",
            "deepspeed=zero2",
        ],
        cwd=REPO,
        check=True,
    )
    m = json.loads((REPO / "runs" / args.run_name / "train" / "manifest.json").read_text())
    r = m["result"]
    from transformers import AutoConfig

    from data.target import resolve_target_path
    from train.config import TargetConfig

    tc = AutoConfig.from_pretrained(resolve_target_path(TargetConfig()))
    H, V = tc.hidden_size, tc.vocab_size
    n_target = 134.5e6
    n_head = r["trainable_parameters"]
    flops = (2 * n_target + 6 * n_head) * r["train_tokens_per_second"] + 8 * H * V * r["supervised_tokens_per_second"]
    print(
        json.dumps(
            {
                "sequence_tokens_per_s": r["train_tokens_per_second"],
                "supervised_tokens_per_s": r["supervised_tokens_per_second"],
                "achieved_tflops": round(flops / 1e12, 2),
                "mfu": round(flops / (args.peak_tflops * 1e12), 4),
                "steps": r["steps"],
                "seconds": r["seconds"],
                "best_tau": r["best"]["tau"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
