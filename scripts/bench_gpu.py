"""GPU check for stage train: every drafter family (eagle, eagle3, medusa, standalone, dflash) for a few hundred steps
in bf16 with DeepSpeed ZeRO-2 on one GPU, then tokens/s and model FLOP utilisation (MFU) per family. One synth
run is shared by all families (on one H200, 2026-12-04: 134 s for 512 x 256 including a one-time 30 s GGUF
conversion; each family's 150 steps plus its held-out check then take well under a minute).

    python3 scripts/bench_gpu.py [--steps 150] [--families eagle,eagle3,medusa,standalone,dflash] [--peak-tflops 989]
    python3 scripts/bench_gpu.py --smoke      # the same plumbing on CPU at toy size (a test runs this)
    python3 scripts/bench_gpu.py --smoke --smoke-device cuda   # toy size on the GPU, bf16, ZeRO-2 (a gpu test)
    python3 scripts/bench_gpu.py --num-prompts 256 --max-new-tokens 128 --steps 100   # a shorter GPU run
    python3 scripts/bench_gpu.py --synth-engines vllm,hf --families eagle3   # stage synth through vLLM vs HF

Everything goes under ``--runs-root`` (default ``$RUNS_ROOT``, else ``runs``; relative: from the repository root),
passed to every stage as ``runs_root=``: the synth run ``<runs>/<run-name>/synth`` (made here, nothing needed
first), each family's ``<runs>/<run-name>_<family>/train`` and the report ``<runs>/<run-name>/bench_gpu.json``.

``--synth-engines``: stage synth runs once per engine on the same 512 prompts x 256 tokens (vLLM: bf16,
compiled, as ``experiment=gpu_node`` sets it; needs vllm importable, or ``DRAFTSMITH_VLLM_PYTHON``), and the
report gives each engine's generated tokens/s from its manifest, the engine's start time, and how many rows
equal the first engine's (bf16 may flip near-ties); the first engine's data trains the families.

MFU counts the useful FLOPs per training step (an estimate, per sequence token unless noted): the frozen
target forward (2 N_target, online features), the drafter's forward and backward (6 N_trainable; EAGLE-3 runs
its layer ``ttt_steps`` times), and the vocabulary projections on supervised tokens (target logits 2 H V;
draft logits forward + backward 6 H V_draft, once per EAGLE-3 TTT step / Medusa head).
Peak: dense bf16 of an H100/H200 SXM (989 TFLOP/s). Not run in CI (needs CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# run as a script from a bare checkout (the GPU machine has no editable install): the repo's packages come first
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--families", default="eagle,eagle3,medusa,standalone,dflash")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--run-name", default="gpu_bench")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a CPU run of the same plumbing at toy size (16 prompts, 3 steps, fp32, no DeepSpeed): checks the "
        "script itself, not the GPU; its MFU figures mean nothing",
    )
    ap.add_argument(
        "--runs-root",
        default=os.environ.get("RUNS_ROOT", "runs"),
        help="where the runs and the report go (default $RUNS_ROOT, else runs; relative: from the repository root)",
    )
    ap.add_argument("--num-prompts", type=int, default=512, help="synth prompts (rows the families train on)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="synth tokens per answer")
    ap.add_argument(
        "--smoke-device",
        default="cpu",
        help="with --smoke: cuda runs the toy sizes on the GPU in bf16 with DeepSpeed ZeRO-2 (a GPU test runs this)",
    )
    ap.add_argument("--synth-engines", default="hf", help="comma list of stage synth engines to time (hf, vllm)")
    ap.add_argument(
        "--no-cudnn-sdpa",
        action="store_true",
        help="every stage with runtime.cudnn_sdpa=false (attention without cuDNN's per-shape plans): the A/B",
    )
    args = ap.parse_args(argv)
    runs = Path(args.runs_root)
    common = ["experiment=quickstart", f"run_name={args.run_name}", f"runs_root={runs}", "wandb.mode=disabled"]
    if args.no_cudnn_sdpa:
        common.append("runtime.cudnn_sdpa=false")
    synth = [
        f"data.num_prompts={args.num_prompts}",
        "synth.batch_size=128",
        f"synth.chunk_size={args.num_prompts}",
        f"synth.max_new_tokens={args.max_new_tokens}",
    ]
    train = ["train.dtype=bfloat16", "train.micro_batch_size=16", "train.eval_prompts=4", "deepspeed=zero2"]
    if args.smoke:
        args.steps = min(args.steps, 3)
        common += [f"target.device={args.smoke_device}", "data.max_heldout=2", "data.max_prompt_tokens=200"]
        synth = ["data.num_prompts=16", "synth.batch_size=8", "synth.chunk_size=16", "synth.max_new_tokens=16"]
        train = ["train.dtype=float32", "train.micro_batch_size=2", "train.eval_prompts=1", "deepspeed=none"]
        if args.smoke_device != "cpu":
            train = ["train.dtype=bfloat16", "train.micro_batch_size=2", "train.eval_prompts=1", "deepspeed=zero2"]
        train += ["train.eval_max_new_tokens=4", "train.warmup_steps=1"]
    engines = [e for e in args.synth_engines.split(",") if e]
    synth_report = {}
    for n, engine in enumerate(engines):
        extra = [f"synth.engine={engine}"]
        if engine == "vllm" and not args.smoke:
            extra += ["synth.vllm_dtype=bfloat16", "synth.vllm_eager=false"]
        name = args.run_name if n == 0 else f"{args.run_name}_synth_{engine}"
        subprocess.run(
            [sys.executable, "-m", "train", "stage=synth", *common, f"run_name={name}", *synth, *extra],
            cwd=REPO,
            check=True,
        )
        synth_report[engine] = json.loads((REPO / runs / name / "synth" / "manifest.json").read_text())["timings"]
    if len(engines) > 1:
        from data.synth_store import load_synth_dataset

        def outs(name: str) -> dict:
            ds = load_synth_dataset(REPO / runs / name / "synth")
            return {(r["source"], r["id"]): r["gen_token_ids"] for r in ds.to_list()}

        ref = outs(args.run_name)
        for engine in engines[1:]:
            other = outs(f"{args.run_name}_synth_{engine}")
            synth_report[engine]["rows_identical_to_" + engines[0]] = (
                f"{sum(other.get(k) == v for k, v in ref.items())}/{len(ref)}"
            )
    print(json.dumps({"synth": synth_report}, indent=2), flush=True)
    from transformers import AutoConfig

    from data.config import TargetConfig
    from data.target import resolve_target_path

    tc = AutoConfig.from_pretrained(resolve_target_path(TargetConfig()))
    H, V = tc.hidden_size, tc.vocab_size
    n_target = 134.5e6
    results: dict[str, dict[str, float]] = {}
    out_dir = REPO / runs / args.run_name
    out_dir.mkdir(parents=True, exist_ok=True)
    for family in args.families.split(","):
        run = f"{args.run_name}_{family}"
        # one family's failure is reported and the next one still runs (a device lease is too short to rerun all)
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "train",
                "stage=train",
                *common,
                f"run_name={run}",
                f"drafter={family}",
                f"synth_dir={runs / args.run_name / 'synth'}",
                "overwrite=true",
                "train.features=online",
                f"train.max_steps={args.steps}",
                "train.save_every=100000",
                *train,
            ],
            cwd=REPO,
            check=False,
        )
        if proc.returncode != 0:
            results[family] = {"error": f"stage train exited with {proc.returncode}"}  # type: ignore[dict-item]
            print(json.dumps({family: results[family]}), flush=True)
            continue
        m = json.loads((REPO / runs / run / "train" / "manifest.json").read_text())
        r, d = m["result"], m["config"]["drafter"]
        n_train = r["trainable_parameters"]
        if family == "eagle3":
            vd = min(V, d["draft_vocab_size"] or V)
            head = 6 * n_train * d["ttt_steps"]
            vocab = 2 * H * V + 6 * H * vd * d["ttt_steps"]
        elif family == "medusa":
            head = 6 * n_train
            vocab = (2 * H * V + 6 * H * V) * d["num_heads"]
        elif family == "dflash":  # fc on every position; per anchor (a supervised token) a block through the layers
            vd, bs, k = min(V, d["draft_vocab_size"] or V), d["block_size"], len(d["layer_ids"] or [0, 0, 0])
            head = 6 * k * H * H
            vocab = 6 * bs * (n_train - k * H * H - H * vd) + (6 + 2) * (bs - 1) * H * vd
        else:
            head = 6 * n_train
            vocab = 8 * H * V
        flops = (2 * n_target + head) * r["train_tokens_per_second"] + vocab * r["supervised_tokens_per_second"]
        results[family] = {
            "sequence_tokens_per_s": r["train_tokens_per_second"],
            "supervised_tokens_per_s": r["supervised_tokens_per_second"],
            "achieved_tflops": round(flops / 1e12, 2),
            "mfu": round(flops / (args.peak_tflops * 1e12), 4),
            "steps": r["steps"],
            "seconds": r["seconds"],
            "best_tau": r["best"]["tau"],
        }
        print(json.dumps({family: results[family]}), flush=True)
        (out_dir / "bench_gpu.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    print(json.dumps(results, indent=2))
    (out_dir / "bench_gpu.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    (out_dir / "bench_gpu_synth.json").write_text(json.dumps(synth_report, indent=2), encoding="utf-8")
    if any("error" in r for r in results.values()):
        raise SystemExit(f"bench_gpu: failed families: {[f for f, r in results.items() if 'error' in r]}")
    return results


if __name__ == "__main__":
    main()
