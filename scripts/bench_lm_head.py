"""What a drafted token costs in the vocabulary projection, against one decoding step of the target.

    python scripts/bench_lm_head.py [--threads 1] [--context 200] [--draft-vocab 8192]

Times, in one process: a target decoding step (1 new token over a ``--context``-token KV cache), and the
target's LM head + log-softmax over the full vocabulary for 1 row (a chain's draft token: EAGLE-1, Medusa,
standalone) and for ``--top-k`` rows (one level of a dynamic tree), and the same over a ``--draft-vocab``-row
slice (EAGLE-3's reduced vocabulary). Prints each as a fraction of the decoding step: the floor of the draft
cost ratio c for a drafter that projects onto that vocabulary.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _time(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from data.config import TargetConfig
    from data.target import load_target

    target = load_target(TargetConfig(device="cpu", dtype="float32"))
    model, H = target.model, target.model.config.hidden_size
    lm = model.get_output_embeddings().weight
    V = lm.shape[0]
    with torch.inference_mode():
        cache = model(torch.randint(0, 1000, (1, args.context)), use_cache=True).past_key_values
        new = torch.tensor([[5]])
        t_step = _time(lambda: model(new, past_key_values=cache, use_cache=False), max(10, args.reps // 2))
        print(f"target decoding step ({args.context}-token context, {args.threads} thread(s)): {t_step * 1e3:.1f} ms")
        for rows in (1, args.top_k):
            x = torch.randn(rows, H)
            for name, w in (
                (f"full vocabulary ({V})", lm),
                (f"draft vocabulary ({args.draft_vocab})", lm[: args.draft_vocab]),
            ):
                t = _time(lambda x=x, w=w: torch.log_softmax(x @ w.T, dim=-1), args.reps)
                print(
                    f"LM head + log-softmax, {rows} row(s), {name}: {t * 1e3:.2f} ms = {t / t_step:.3f} decoding steps"
                )


if __name__ == "__main__":
    main()
