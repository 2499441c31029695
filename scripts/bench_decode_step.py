"""One decode step of the target, timed: the unit of stage synth's HF engine and of replay's continuations.

    python scripts/bench_decode_step.py [--rows 64] [--width 400] [--no-prepack] [--wait-policy cli]
        [--steps 5] [--profile]

Builds the engine's slot cache (``data.generate.slot_cache``) of ``--rows`` rows x ``--width`` cached columns
(random keys and values: the cost does not depend on them), then times ``--steps`` decode steps of the embedded
float32 target after 3 of warm-up, with oneDNN-prepacked weights (``data/prepack.py``) unless ``--no-prepack``.
``--profile`` prints torch's operator table (where a step's time goes). ``--wait-policy`` chooses how OpenMP
threads wait before torch loads: ``cli`` (default) as ``python -m train`` has them (``train/omp.py``:
``GOMP_SPINCOUNT=2000`` unless the environment says otherwise), or ``OMP_WAIT_POLICY`` PASSIVE / ACTIVE, or
``unset`` (libgomp's default: spin ~300,000 times, then sleep; ``GOMP_SPINCOUNT`` from the environment still
applies). For the neighbour case run two at once. Prints seconds per step and tokens/s (rows / step).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--width", type=int, default=400, help="cached columns each row attends to")
    ap.add_argument("--no-prepack", action="store_true", help="F.linear instead of the prepacked weights")
    ap.add_argument("--wait-policy", default="cli", choices=["cli", "PASSIVE", "ACTIVE", "unset"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if args.wait_policy == "cli":
        from train.omp import set_default_wait

        set_default_wait()
    elif args.wait_policy == "unset":
        os.environ.pop("OMP_WAIT_POLICY", None)
    else:
        os.environ["OMP_WAIT_POLICY"] = args.wait_policy

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from data.config import TargetConfig
    from data.generate import slot_cache
    from data.modeling import model_forward
    from data.prepack import prepacked_linears
    from data.target import load_target

    torch.set_num_threads(args.threads)
    model = load_target(TargetConfig(device="cpu")).model
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    g = torch.Generator().manual_seed(0)
    shape = (args.rows, c.num_key_value_heads, args.width + 64, head_dim)
    bufs = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(c.num_hidden_layers)]
    ids = torch.randint(0, c.vocab_size, (args.rows, 1), generator=g)
    lens = torch.full((args.rows, 1), args.width)
    mask = torch.ones(args.rows, args.width + 1, dtype=torch.long)

    @torch.inference_mode()
    def step() -> None:
        model_forward(model, ids, slot_cache(model, bufs, 0, args.width), lens, mask)

    with prepacked_linears(model, enabled=not args.no_prepack, rows=args.rows) as packed:
        for _ in range(3):
            step()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        per_step = (time.perf_counter() - t0) / args.steps
        print(
            f"rows={args.rows} width={args.width} prepacked_layers={packed} OMP_WAIT_POLICY="
            f"{os.environ.get('OMP_WAIT_POLICY', 'unset')} GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', 'unset')}: "
            f"{per_step:.4f} s/step, {args.rows / per_step:.1f} tokens/s"
        )
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.steps):
                    step()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
