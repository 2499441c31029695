"""Stage synth's generation engines side by side on the same prompts: tokens/s and token-for-token equality.

    python scripts/bench_engine.py [--batch-sizes 16,32,64] [--max-new-tokens 64] [hydra overrides ...]

Default prompts: the quickstart's own training conversations (``experiment=quickstart``: 100 ShareGPT +
HumanEval first turns, <= 384 prompt tokens), greedy, fp32, in one process after a warm-up:

* ``hf_generate`` at ``synth.batch_size`` (16): transformers' ``generate`` on length-sorted, left-padded batches --
  stage synth's engine before continuous batching, the baseline every ratio is against;
* ``hf`` (continuous batching, data/generate.py) at each ``--batch-sizes`` value.

Both run through ``data.synth.synth_chunk`` (what stage synth runs), so rows, decoding and detokenising are
included. Prints tokens/s, the ratio to the baseline, and whether every row's tokens equal the baseline's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI sets it (2 threads spin otherwise)

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

logger = logging.getLogger("bench_engine")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="16,32,64", help="continuous-batching batch sizes to time")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides (default: experiment=quickstart)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from data.render import prompt_ids
    from data.sources import Conversation, SkipCounter
    from data.split import select
    from data.synth import synth_chunk
    from data.target import load_target
    from train.config import register_configs

    register_configs()
    conf = Path(__file__).resolve().parent.parent / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("config", overrides=args.overrides or ["experiment=quickstart"]))
    torch.set_num_threads(cfg.runtime.num_threads or torch.get_num_threads())
    target = load_target(cfg.target)
    tok = target.tokenizer

    def first_len(c: Conversation) -> int:  # as stage synth measures prompts
        i = next(j for j, m in enumerate(c.messages) if m["role"] == "user")
        return len(prompt_ids(tok, c.messages[: i + 1]))

    convs = select(cfg.data, SkipCounter(), prompt_len=first_len).train
    base_cfg = replace(cfg.synth, max_new_tokens=args.max_new_tokens, temperature=0.0)
    synth_chunk(target, convs[:4], replace(base_cfg, max_new_tokens=4), cfg.data.max_prompt_tokens, None)  # warm-up

    def run(engine: str, bs: int) -> dict:
        c = replace(base_cfg, engine=engine, batch_size=bs)
        t0 = time.perf_counter()
        rows, stats = synth_chunk(target, convs, c, cfg.data.max_prompt_tokens, None)
        dt = time.perf_counter() - t0
        outs = {(r["source"], r["id"]): r["gen_token_ids"] for r in rows}
        return {
            "engine": engine,
            "batch_size": bs,
            "seconds": round(dt, 2),
            "generated_tokens": stats.generated_tokens,
            "tokens_per_s": round(stats.generated_tokens / dt, 1),
            "padded_prompt_tokens": stats.padded_tokens,
            "outputs": outs,
        }

    base = run("hf_generate", cfg.synth.batch_size)
    results = [base]
    for bs in [int(x) for x in args.batch_sizes.split(",") if x]:
        results.append(run("hf", bs))
    report = {
        "prompts": len(convs),
        "turns_per_conversation": cfg.data.max_turns,
        "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(),
        "runs": [],
    }
    for r in results:
        same = sum(r["outputs"].get(k) == v for k, v in base["outputs"].items())
        row = {k: v for k, v in r.items() if k != "outputs"}
        row.update({"vs_hf_generate": round(r["tokens_per_s"] / base["tokens_per_s"], 2), "rows_identical": same})
        report["runs"].append(row)
        logger.info(
            "%-11s bs=%-3d %7.1f s  %6.1f tokens/s  %.2fx  identical rows %d/%d",
            r["engine"],
            r["batch_size"],
            r["seconds"],
            r["tokens_per_s"],
            row["vs_hf_generate"],
            same,
            len(base["outputs"]),
        )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
