"""Where a decoding step of the HF synth engine spends its time: in the model forward, or in the engine's own work
around it; and how many ATen calls one eager forward of the target dispatches (on a GPU each costs host time
while its kernel takes microseconds, so a small model's step is bound by dispatch, whatever the batch).

    python3 scripts/probe_engine_host.py [--synth-dir <runs>/quickstart/synth] [--batch 64 128] [--max-new-tokens 64]
    python3 scripts/probe_engine_host.py --device cuda ...   # the same on a GPU

``<runs>`` is ``--runs-root`` (default ``$RUNS_ROOT``, else ``runs``). Needs a finished stage synth in
``--synth-dir`` (the default one is made by ``python -m train stage=synth experiment=quickstart runs_root=<runs>``).

Prompts: the prompt part of a synth run's rows (repeated to fill the largest batch). Prints one line per batch
size, then the forward's dispatch count (torch profiler, batch 1, one decoding step on a 32-token cache).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _prompts(synth_dir: str, n: int) -> list[list[int]]:
    from data.synth_store import load_synth_dataset

    out = []
    for row in load_synth_dataset(synth_dir):
        ids, mask = row["input_ids"], row["loss_mask"]
        out.append(ids[: mask.index(1) if 1 in mask else len(ids)])
    if not out:
        raise SystemExit(f"{synth_dir} has no rows")
    return (out * (n // len(out) + 1))[:n]


def engine_split(model: Any, eos: int, prompts: Sequence[Sequence[int]], batch: int, new: int) -> dict[str, float]:
    """The engine run once with ``model_forward`` timed: decoding steps' time outside vs inside the forward."""
    import torch

    import data.generate as g

    inside = {"decode": 0.0, "decode_calls": 0, "all": 0.0}
    orig = g.model_forward

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = orig(*args, **kwargs)
        if args[1].device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        inside["all"] += dt
        if args[1].shape[1] == 1:
            inside["decode"] += dt
            inside["decode_calls"] += 1
        return out

    g.model_forward = timed
    try:
        _, st = g.continuous_generate(model, prompts, new, eos_token_id=eos, batch_size=batch)
    finally:
        g.model_forward = orig
    steps = max(1, st.decode_steps)
    return {
        "decode_steps": st.decode_steps,
        "forward_ms_per_step": 1000 * inside["decode"] / max(1, inside["decode_calls"]),
        "engine_ms_per_step": 1000 * (st.decode_seconds - inside["decode"]) / steps,
        "cache_rebuilds": st.cache_rebuilds,
        "prefill_s": st.prefill_seconds,
        "generated_tokens": st.generated_tokens,
    }


def dispatch_count(model: Any) -> dict[str, Any]:
    """ATen calls in one batch-1 decoding forward on a 32-token cache, and the most frequent ones."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import data.modeling as g

    device = next(model.parameters()).device
    cache = g.new_cache(model)
    with torch.no_grad():
        g.model_forward(model, torch.randint(0, 1000, (1, 32), device=device), cache)
        step = torch.tensor([[5]], device=device)
        for _ in range(3):
            g.model_forward(model, step, cache)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            g.model_forward(model, step, cache)
    calls = {e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::")}
    top = sorted(calls.items(), key=lambda kv: -kv[1])[:8]
    return {"aten_calls": sum(calls.values()), "top": top}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs-root", default=os.environ.get("RUNS_ROOT", "runs"), help="default $RUNS_ROOT, else runs")
    ap.add_argument("--synth-dir", default=None, help="default <runs>/quickstart/synth")
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    args.synth_dir = args.synth_dir or str(Path(args.runs_root) / "quickstart" / "synth")
    if not (Path(args.synth_dir) / "manifest.json").is_file():
        raise SystemExit(
            f"no synth data in {args.synth_dir}: make it with python -m train stage=synth experiment=quickstart "
            f"runs_root={args.runs_root} (or pass --synth-dir)"
        )
    from data.config import TargetConfig
    from data.target import load_target

    target = load_target(TargetConfig(device=args.device))
    prompts = _prompts(args.synth_dir, max(args.batch))
    for b in args.batch:
        r = engine_split(target.model, target.tokenizer.eos_token_id, prompts[:b], b, args.max_new_tokens)
        print(
            f"batch {b}: {r['decode_steps']} decoding steps; forward {r['forward_ms_per_step']:.1f} ms a step, "
            f"the engine's own work {r['engine_ms_per_step']:.1f} ms a step ({r['cache_rebuilds']} cache rebuilds); "
            f"prefill {r['prefill_s']:.2f} s",
            flush=True,
        )
    d = dispatch_count(target.model)
    print(f"one decoding forward (batch 1): {d['aten_calls']} ATen calls; most frequent {d['top']}")


if __name__ == "__main__":
    main()
