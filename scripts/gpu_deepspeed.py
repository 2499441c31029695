"""DeepSpeed on a GPU node, prepared for the first minutes of a GPU machine: ZeRO-2 and ZeRO-3 on 1 GPU and on
all GPUs of the node, every family trains a few steps and resumes from a checkpoint; printed as one table.

For each engine x process count x family: an uninterrupted run of ``2 * steps`` steps, and the same run stopped at
``steps`` (``train.stop_after_steps``, a checkpoint in DeepSpeed's files) then resumed (``resume=true``). The table
gives the engine the manifest names, training tokens/s, peak GPU memory per process, and whether the resumed run's
losses equal the uninterrupted run's (relative 1e-5).

    python scripts/gpu_deepspeed.py                      # on the GPU machine (bf16, the quickstart synth data)
    python scripts/gpu_deepspeed.py --smoke              # on a CPU: the same plumbing on a tiny random target
Everything goes under ``<runs-root>/gpu_deepspeed`` (``--runs-root``: default ``$RUNS_ROOT``, else ``runs``;
relative: from the repository root), its synth data included (made there first when missing; every stage also gets
``runs_root=``). Writes ``<runs-root>/gpu_deepspeed/report.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
FAMILIES = ("eagle", "eagle3", "medusa", "standalone")


def _train(args: list[str], nproc: int, port: int) -> None:
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port)]
    subprocess.run([*launcher, "-m", "train", *args], cwd=REPO, check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="steps before the stop; the reference runs twice as many")
    ap.add_argument("--engines", default="zero2,zero3")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument(
        "--runs-root",
        default=os.environ.get("RUNS_ROOT", "runs"),
        help="default $RUNS_ROOT, else runs (relative: from the repository root)",
    )
    ap.add_argument("--smoke", action="store_true", help="a CPU check of this script on a tiny random target")
    a = ap.parse_args(argv)
    root = REPO / a.runs_root / "gpu_deepspeed"  # the stages run in the repository root: the same directory there
    common = ["experiment=quickstart", "wandb.mode=disabled", "train.features=online", "train.ema_decay=0"]
    common.append(f"runs_root={a.runs_root}")
    common += ["train.eval_prompts=2", "train.eval_max_new_tokens=16"]
    if a.smoke:
        from data.tiny_target import make_tiny_target

        path = make_tiny_target("llama", root / "tiny_llama")
        common += ["target=hf", f"target.path={path}", "data.num_prompts=8", "data.max_heldout=2"]
        common += ["synth.max_new_tokens=12", "data.max_prompt_tokens=200", "train.micro_batch_size=2"]
        procs = [1, 2]
    else:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no GPU visible: run with --smoke on a CPU")
        common += ["train.dtype=bfloat16", "train.micro_batch_size=8"]
        procs = sorted({1, torch.cuda.device_count()})
    synth = root / "synth"
    if not (synth / "manifest.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "train", "stage=synth", *common, f"hydra.run.dir={synth}"], cwd=REPO, check=True
        )
    steps = a.steps
    rows: list[dict[str, Any]] = []
    port = 29591
    for engine in a.engines.split(","):
        for nproc in procs:
            for family in a.families.split(","):
                port += 1
                base = ["stage=train", *common, f"synth_dir={synth}", f"drafter={family}", f"deepspeed={engine}"]
                base += [f"train.max_steps={2 * steps}", f"train.save_every={steps}", "train.log_every=1"]
                ref, cut = root / f"{engine}_{nproc}_{family}_ref", root / f"{engine}_{nproc}_{family}_resumed"
                for d in (ref, cut):  # a rerun of this script starts these runs again
                    shutil.rmtree(d, ignore_errors=True)
                t0 = time.perf_counter()
                _train([*base, f"hydra.run.dir={ref}"], nproc, port)
                _train([*base, f"hydra.run.dir={cut}", f"train.stop_after_steps={steps}"], nproc, port)
                _train([*base, f"hydra.run.dir={cut}", "resume=true"], nproc, port)
                m_ref = json.loads((ref / "manifest.json").read_text())
                m_cut = json.loads((cut / "manifest.json").read_text())
                a_loss = [x for _, x in m_ref["losses"]]
                b_loss = [x for _, x in m_cut["losses"]]
                same = len(a_loss) == len(b_loss) and all(
                    abs(x - y) <= 1e-5 * max(abs(x), 1e-12) for x, y in zip(a_loss, b_loss, strict=True)
                )
                r = m_ref["result"]
                rows.append(
                    {
                        "engine": r["engine"],
                        "processes": r["world_size"],
                        "family": family,
                        "tokens_per_s": r["train_tokens_per_second"],
                        "peak_gpu_mb_per_process": r.get("peak_gpu_mb_per_process"),
                        "peak_rss_mb_per_process": r.get("peak_rss_mb_per_process"),
                        "resume_equal": same,
                        "final_loss": a_loss[-1],
                        "wall_s": round(time.perf_counter() - t0, 1),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    (root / "report.json").write_text(json.dumps({"steps": steps, "rows": rows}, indent=2) + "\n")
    print("\n| engine | processes | family | tokens/s | peak GPU MB / process | resume equal | final loss |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        mem = r["peak_gpu_mb_per_process"] or r["peak_rss_mb_per_process"]
        print(
            f"| {r['engine']} | {r['processes']} | {r['family']} | {r['tokens_per_s']:.0f} | {mem} | "
            f"{r['resume_equal']} | {r['final_loss']:.4f} |"
        )
    return 0 if all(r["resume_equal"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
