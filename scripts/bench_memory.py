"""Peak memory of one training step on a synth run's longest rows, as stage train runs it.

    python scripts/bench_memory.py --synth-dir DIR [--batch-sizes 1 4] [--threads 2] [Hydra overrides ...]

Composes the config from the overrides (default ``experiment=quickstart drafter=eagle3``; add
``train.max_seq_len=4096`` for long rows: the rows are read as stage train reads them, cut at that length), loads
the target and a fresh drafter of the configured family (with its ``prepare`` on every row, e.g. EAGLE-3's draft
vocabulary), then for each micro-batch size B, one after the other: the B longest rows padded to the longest as
stage train pads them, the target's forward for the features (what stage features does per batch), the family's
loss, backward and an AdamW step. Prints the process's peak RSS after loading, after the forward and after the step
(peak RSS is a high-water mark: the batch sizes run in increasing order). Rows come from any synth run, e.g. long
ShareGPT conversations with their own answers (``stage=synth data.max_turns=16 synth.regenerate=false
data.max_prompt_tokens=4096 synth.max_seq_len=4096``).
"""

from __future__ import annotations

import argparse
import gc
import resource
import time
from pathlib import Path

import torch

from data.target import load_target, output_head
from train.batches import BatchPlan, load_rows
from train.config import compose_config
from train.drafters import registry
from train.drafters.registry import TargetFeatures


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--synth-dir", required=True, type=Path)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("overrides", nargs="*", default=["experiment=quickstart", "drafter=eagle3"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = compose_config(["stage=train", *args.overrides])
    rows = load_rows(args.synth_dir, cfg.train.max_seq_len)  # as stage train reads them
    rows.sort(key=lambda r: len(r.input_ids))
    target = load_target(cfg.target)
    spec = registry.get(cfg.drafter.name)
    module = spec.build(cfg.drafter, target.model).float()
    if spec.prepare is not None:
        spec.prepare(module, rows, cfg.drafter, target.model)
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)
    layers = spec.feature_layers(cfg.drafter, target.model.config)
    n = target.model.config.num_hidden_layers
    plan = BatchPlan(rows, 1, 1, 0, target.tokenizer.pad_token_id)  # its collate: stage train's padding
    print(f"{len(rows)} rows, longest {[len(r.input_ids) for r in rows[-4:]]}; loaded: peak RSS {peak_gib():.2f} GiB")
    for b in sorted(args.batch_sizes):
        batch = rows[-b:]
        tb = plan.collate(batch)
        width = tb.input_ids.shape[1]
        t0 = time.perf_counter()
        with torch.no_grad():
            hs = target.model(
                input_ids=tb.input_ids, attention_mask=tb.attention_mask, output_hidden_states=True
            ).hidden_states
        feats = TargetFeatures({i: hs[i] for i in layers}, n, output_head(target.model))
        del hs
        gc.collect()
        forward_s, after_forward = time.perf_counter() - t0, peak_gib()
        t0 = time.perf_counter()
        loss, _ = spec.loss(module, tb, feats, cfg.drafter)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(
            f"micro-batch {b} x {width} tokens: after the target's forward ({forward_s:.1f} s) peak RSS "
            f"{after_forward:.2f} GiB; after the step ({time.perf_counter() - t0:.1f} s) peak RSS {peak_gib():.2f} GiB"
        )


if __name__ == "__main__":
    main()
