"""Sampled replay against the sampling decoder itself, on the same held-out prompts: tau, intervals, time.

    python scripts/bench_sampled_replay.py run_name=quickstart experiment=quickstart eval.temperature=1.0 \\
        eval.samples=6 eval.max_new_tokens=32

Arguments are Hydra overrides of the project config (the run's own experiment and run_name); the drafter is
``<train_dir>/best`` (or ``eval.drafter_dir``), the methods are ``eval.proposers`` (drafter chain + tree, prompt
lookup, ...). The run must exist (``python -m train stage=all experiment=<exp>``). For every method:

1. the lossless speculative *sampling* decoder (:class:`eval.decoder.SpeculativeDecoder` at ``eval.temperature`` /
   ``eval.top_p``) generates ``eval.max_new_tokens`` from every held-out prompt, once per seed ``eval.seed ..
   eval.seed + eval.samples - 1``: its tau, pooled, with a 95% bootstrap interval over prompts;
2. sampled replay (what stage eval does at temperature > 0: ``eval.samples`` paths sampled from the target per
   prompt, the decoder's acceptance law along each, :mod:`eval.replay`) on the same prompts: the same figures.

The two are independent samples of the same law, so they agree up to sampling noise; prints (and writes
``bench_sampled_replay.json`` in ``--out``) both taus, their intervals and their ratio, and the seconds each took in
this process (replay: continuations, traces and walks, for all methods at once).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from train.omp import set_default_wait

set_default_wait()  # OpenMP threads wait as the CLI has them (train/omp.py), set before torch loads

import torch  # noqa: E402

logger = logging.getLogger("bench_sampled_replay")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="where the json goes (default: <run>/bench_sampled_replay)")
    ap.add_argument("--runs-root", default=os.environ.get("RUNS_ROOT", "runs"), help="runs_root unless given")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if not any(o.lstrip("+").startswith("runs_root=") for o in args.overrides):
        args.overrides.insert(0, f"runs_root={args.runs_root}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from data.target import load_target
    from eval.decoder import SpeculativeDecoder
    from eval.metrics import DecodeStats
    from eval.run import build_methods, replay_methods, select_prompts
    from eval.stats import bootstrap_tau_ci
    from train.config import compose_config
    from train.drafters.registry import load_drafter

    cfg = compose_config(args.overrides)
    e = cfg.eval
    if not e.temperature > 0:
        raise SystemExit("give eval.temperature > 0 (this compares sampled replay with the sampling decoder)")
    if not (Path(cfg.synth_dir) / "manifest.json").is_file():
        raise SystemExit(f"no synth data in {cfg.synth_dir}: make the run first (python -m train stage=all ...)")
    torch.set_num_threads(cfg.runtime.num_threads or torch.get_num_threads())
    out_dir = Path(args.out or Path(cfg.runs_root) / cfg.run_name / "bench_sampled_replay")
    target = load_target(cfg.target)
    prompts = select_prompts(cfg, target)
    methods = [m for m in build_methods(cfg, target, load_drafter) if m.proposer is not None]
    eos = target.tokenizer.eos_token_id

    t0 = time.perf_counter()
    replayed, _ = replay_methods(cfg, target, prompts, methods, out_dir)
    t_replay = time.perf_counter() - t0
    report: dict[str, object] = {
        "temperature": e.temperature,
        "top_p": e.top_p,
        "prompts": len(prompts),
        "samples_per_prompt": e.samples,
        "max_new_tokens": e.max_new_tokens,
        "replay_seconds_all_methods": round(t_replay, 1),
        "methods": {},
    }
    for m in methods:
        dec = SpeculativeDecoder(target.model, m.proposer, temperature=e.temperature, top_p=e.top_p)
        per_prompt: list[DecodeStats] = []
        t1 = time.perf_counter()
        for i, p in enumerate(prompts):
            merged = DecodeStats()
            for s in range(e.samples):
                gen = torch.Generator().manual_seed(e.seed + s)
                merged = merged.merge(dec.generate(torch.tensor([p.input_ids]), e.max_new_tokens, eos, gen).stats)
            per_prompt.append(merged)
            if (i + 1) % 10 == 0:
                logger.info("%s: decoded %d / %d prompts x %d seeds", m.name, i + 1, len(prompts), e.samples)
        t_dec = time.perf_counter() - t1
        d_all = DecodeStats.merge_all(per_prompt)
        r = replayed[m.name]
        rec = {
            "decode_tau": d_all.tau(),
            "decode_tau_ci": bootstrap_tau_ci(per_prompt, seed=e.seed),
            "decode_alpha": d_all.alpha()[:5],
            "replay_tau": r.stats["all"].tau(),
            "replay_tau_ci": bootstrap_tau_ci(r.per_prompt["all"], seed=e.seed),
            "replay_alpha": r.stats["all"].alpha()[:5],
            "replay_over_decode": r.stats["all"].tau() / d_all.tau(),
            "generations": len(prompts) * e.samples,
            "decode_seconds": round(t_dec, 1),
        }
        report["methods"][m.name] = rec  # type: ignore[index]
        logger.info(
            "%s: decoder tau %.3f [%.3f, %.3f], replay %.3f [%.3f, %.3f]: ratio %.3f (%d generations; decode %.0f s)",
            m.name,
            rec["decode_tau"],
            *rec["decode_tau_ci"],
            rec["replay_tau"],
            *rec["replay_tau_ci"],
            rec["replay_over_decode"],
            rec["generations"],
            t_dec,
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_sampled_replay.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
