"""What EAGLE-3's training step costs with the TTT unroll restricted to the needed entries, against the full unroll.

    python scripts/bench_ttt.py [--runs-root runs] [--synth-dir <runs>/quickstart/synth] [--batches 6] [--threads 2]

``<runs>`` is ``--runs-root`` (default ``$RUNS_ROOT``, else ``runs``). Needs a finished stage synth in
``--synth-dir`` (the default one is made by ``python -m train stage=synth experiment=quickstart runs_root=<runs>``);
it stops at once, naming that command, without it.

On a synth run's real rows, batched as training batches them (length-bucketed micro-batches of 8), with the real
target's features (computed first, not timed), times in one process the EAGLE-3 loss + backward two ways,
interleaved on the same batches: the full unroll (every entry through every TTT step,
``loss_fn(needed_only=False)``) and the default (entries whose chain never reaches a target-written token give
step 0's keys/values only). Prints the seconds per step of each, their ratio, the share of entries that are
needed, and the largest relative difference of the loss and of the gradients (they must agree to rounding).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs-root", default=os.environ.get("RUNS_ROOT", "runs"), help="default $RUNS_ROOT, else runs")
    ap.add_argument("--synth-dir", default=None, help="default <runs>/quickstart/synth")
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--max-seq-len", type=int, default=768)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    args.synth_dir = args.synth_dir or str(Path(args.runs_root) / "quickstart" / "synth")
    if not (Path(args.synth_dir) / "manifest.json").is_file():
        raise SystemExit(
            f"no synth data in {args.synth_dir}: make it with python -m train stage=synth experiment=quickstart "
            f"runs_root={args.runs_root} (or pass --synth-dir)"
        )
    torch.set_num_threads(args.threads)

    from data.config import TargetConfig
    from data.target import load_target
    from train.batches import BatchPlan, load_rows
    from train.drafters import registry
    from train.drafters.eagle3 import loss_fn
    from train.drafters.registry import TargetFeatures

    target = load_target(TargetConfig(device="cpu"))
    rows = load_rows(args.synth_dir, args.max_seq_len)
    plan = BatchPlan(rows, args.micro_batch_size, 64, 0, target.tokenizer.pad_token_id)
    spec = registry.get("eagle3")
    cfg = spec.config_cls(ttt_steps=args.ttt_steps, norm_before_fc=True, norm_before_residual=True, norm_output=True)
    torch.manual_seed(0)
    head = spec.build(cfg, target.model).float()
    spec.prepare(head, rows, cfg, target.model)
    head.train()
    layers = spec.feature_layers(cfg, target.model.config)
    n_layers = target.model.config.num_hidden_layers
    work = []
    for i in range(args.batches):
        batch = plan.batch(i)
        with torch.no_grad():
            hs = target.model(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True
            ).hidden_states
        work.append((batch, TargetFeatures({j: hs[j] for j in layers}, n_layers, target.model.get_output_embeddings())))
    seconds: dict[bool, list[float]] = {False: [], True: []}
    worst_loss = worst_grad = 0.0
    tokens = needed_tokens = 0
    for batch, feats in work:
        grads = {}
        losses = {}
        for needed_only in (False, True):
            head.zero_grad()
            t0 = time.perf_counter()
            loss, _ = loss_fn(head, batch, feats, cfg, needed_only=needed_only)
            loss.backward()
            seconds[needed_only].append(time.perf_counter() - t0)
            losses[needed_only] = float(loss.detach())
            grads[needed_only] = [p.grad.clone() for p in head.parameters() if p.grad is not None]
        worst_loss = max(worst_loss, abs(losses[True] - losses[False]) / abs(losses[False]))
        for a, b in zip(grads[False], grads[True], strict=True):
            worst_grad = max(worst_grad, float((a - b).abs().max() / (a.abs().max() + 1e-30)))
        am, lm = batch.attention_mask, batch.loss_mask
        tokens += int(am.sum())
        needed_tokens += int(lm.sum()) + args.ttt_steps * int((lm.sum(1) > 0).sum())
    full, needed = statistics.median(seconds[False]), statistics.median(seconds[True])
    print(f"{len(work)} batches of {args.micro_batch_size} rows from {args.synth_dir}, {tokens} sequence tokens")
    print(f"target-written share of the tokens: {needed_tokens / tokens:.2f} (about the share of entries unrolled)")
    print(f"loss + backward, median seconds per batch: full unroll {full:.3f}, needed entries only {needed:.3f}")
    print(f"speedup: {full / needed:.2f}x")
    print(f"largest relative difference: loss {worst_loss:.1e}, gradients {worst_grad:.1e}")


if __name__ == "__main__":
    main()
