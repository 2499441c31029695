"""Replay vs decode on the same held-out prompts: time, and how often the two disagree (near-tie flips).

    python scripts/bench_replay.py run_name=quickstart experiment=quickstart eval.num_prompts=24 \\
        eval.max_new_tokens=128 [--decode-prompts 8] [--lanes-compare 16]

Arguments are Hydra overrides of the project config (the run's own experiment and run_name); the drafter is
``<train_dir>/best`` (or ``eval.drafter_dir``), the methods are ``eval.proposers`` (drafter chain + tree, prompt
lookup, ...). ``--runs-root`` (default ``$RUNS_ROOT``, else ``runs``) becomes the override ``runs_root=`` unless
one is given. The run must exist first (its synth data and trained drafter: ``python -m train stage=all
experiment=<exp> runs_root=<runs>``); without its synth data the script stops at once, naming that command. It

1. makes (or reuses) the greedy continuations of every prompt (timed; cached as stage eval caches them);
2. replays every method on every prompt, ``eval.replay_lanes`` prompts at a time (one target trace per prompt,
   shared by the methods; wall time);
3. with ``--lanes-compare N``: replays the first N prompts again with lanes=1 and with ``eval.replay_lanes``,
   back to back (the lanes' speedup, and whether any trajectory differs between them);
4. decodes every method with the real speculative decoder on the first ``--decode-prompts`` prompts per source
   (timed) and compares, prompt by prompt, emitted tokens and accepted counts with replay.

Prints (and writes ``bench_replay.json`` in ``--out``) the times as ratios against decoding in the same process
(decode's time per prompt times the number of replayed prompts, where decoding all of them would take hours), and
the number of prompts where replay and decode differ (0 expected; a difference is an fp32 near-tie that the
batched trace and the incremental decoder round differently).
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

logger = logging.getLogger("bench_replay")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode-prompts", type=int, default=4, help="prompts per source also decoded")
    ap.add_argument("--lanes-compare", type=int, default=0, help="also replay the first N prompts with lanes=1")
    ap.add_argument("--out", default=None, help="where bench_replay.json goes (default: <run>/bench_replay)")
    ap.add_argument(
        "--runs-root",
        default=os.environ.get("RUNS_ROOT", "runs"),
        help="the overrides' runs_root unless they name one (default $RUNS_ROOT, else runs)",
    )
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if not any(o.lstrip("+").startswith("runs_root=") for o in args.overrides):
        args.overrides.insert(0, f"runs_root={args.runs_root}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from data.target import load_target
    from eval.decoder import SpeculativeDecoder
    from eval.metrics import DecodeStats
    from eval.replay import replay_many
    from eval.run import build_methods, first_per_source, load_continuations, select_prompts
    from train.config import compose_config
    from train.drafters.registry import load_drafter

    cfg = compose_config(args.overrides)
    if not (Path(cfg.synth_dir) / "manifest.json").is_file():
        raise SystemExit(
            f"no synth data in {cfg.synth_dir}: make the run first with python -m train stage=all "
            f"experiment=<exp> run_name={cfg.run_name} runs_root={cfg.runs_root}"
        )
    torch.set_num_threads(cfg.runtime.num_threads or torch.get_num_threads())
    out_dir = Path(args.out or Path(cfg.runs_root) / cfg.run_name / "bench_replay")
    e = cfg.eval
    target = load_target(cfg.target)
    prompts = select_prompts(cfg, target)
    methods = [m for m in build_methods(cfg, target, load_drafter) if m.proposer is not None]
    eos = target.tokenizer.eos_token_id

    t0 = time.perf_counter()
    conts = load_continuations(cfg, target, prompts, out_dir)
    t_cont = time.perf_counter() - t0

    proposers = {m.name: m.proposer for m in methods}
    t0 = time.perf_counter()
    stats, outputs, trace_s = replay_many(
        target.model, proposers, prompts, conts, e.max_new_tokens, eos, lanes=e.replay_lanes
    )
    t_replay = time.perf_counter() - t0

    def same_run(a: DecodeStats, b: DecodeStats) -> bool:
        return a.accepted_lengths == b.accepted_lengths and a.draft_tokens_proposed == b.draft_tokens_proposed

    lanes_report: dict[str, object] = {}
    if args.lanes_compare:
        sub, sub_conts = prompts[: args.lanes_compare], conts[: args.lanes_compare]
        times: dict[int, float] = {}
        runs: dict[int, tuple] = {}
        for lanes in (1, e.replay_lanes):
            t1 = time.perf_counter()
            runs[lanes] = replay_many(target.model, proposers, sub, sub_conts, e.max_new_tokens, eos, lanes=lanes)
            times[lanes] = time.perf_counter() - t1
        (st1, out1, _), (stl, outl, _) = runs[1], runs[e.replay_lanes]
        differ = sum(out1[n][k] != outl[n][k] for n in proposers for k in out1[n]) + sum(
            not same_run(a, b)
            for n in proposers
            for src in st1[n]
            for a, b in zip(st1[n][src], stl[n][src], strict=True)
        )
        lanes_report = {
            "prompts": len(sub),
            "seconds_lanes_1": round(times[1], 2),
            f"seconds_lanes_{e.replay_lanes}": round(times[e.replay_lanes], 2),
            "speedup": round(times[1] / times[e.replay_lanes], 2),
            "trajectories_that_differ": differ,
        }
        logger.info("lanes: %s", lanes_report)

    dprompts = first_per_source(prompts, args.decode_prompts)
    report: dict[str, object] = {
        "prompts": len(prompts),
        "max_new_tokens": e.max_new_tokens,
        "replay_lanes": e.replay_lanes,
        "continuations_seconds": round(t_cont, 2),
        "trace_seconds": round(trace_s, 2),
        "replay_seconds_all_methods": round(t_replay, 2),
        "lanes_compare": lanes_report,
        "decode_prompts": len(dprompts),
        "methods": {},
    }
    t_dec_all = 0.0
    for m in methods:
        per_source = {src: iter(lst) for src, lst in stats[m.name].items()}  # in prompt order within each source
        replay_of = {f"{p.source}:{p.id}": next(per_source[p.source]) for p in prompts}
        dec = SpeculativeDecoder(target.model, m.proposer)
        t_dec, differ = 0.0, []
        for p in dprompts:
            key = f"{p.source}:{p.id}"
            t1 = time.perf_counter()
            r = dec.generate(torch.tensor([p.input_ids]), e.max_new_tokens, eos)
            t_dec += time.perf_counter() - t1
            if not (r.tokens == outputs[m.name][key] and same_run(r.stats, replay_of[key])):
                differ.append(key)
        t_dec_all += t_dec
        all_stats = DecodeStats.merge_all([s for lst in stats[m.name].values() for s in lst])
        report["methods"][m.name] = {  # type: ignore[index]
            "replay_tau_all": all_stats.tau(),
            # this method's drafting in the shared replay (a batched replayer: the prompts' shares of its rounds add
            # up to its wall time; lane threads: every lane's time, waits included, so more than wall time)
            "replay_draft_seconds": round(all_stats.draft_time_s, 2),
            "decode_seconds_sample": round(t_dec, 2),
            "decode_seconds_per_prompt": round(t_dec / max(1, len(dprompts)), 2),
            "prompts_where_replay_differs": differ,
        }
        logger.info(
            "%s: decode %.1f s for %d prompts; %d of them differ from replay", m.name, t_dec, len(dprompts), len(differ)
        )
    est = t_dec_all / max(1, len(dprompts)) * len(prompts)
    report["decode_estimate_all_methods_seconds"] = round(est, 1)
    report["decode_estimate_over_replay"] = round(est / max(t_replay, 1e-9), 1)
    logger.info(
        "replay of %d prompts x %d tokens, %d methods: %.1f s (target traces %.1f s of it); decoding them would take "
        "about %.0f s (%.1fx)",
        len(prompts),
        e.max_new_tokens,
        len(methods),
        t_replay,
        trace_s,
        est,
        est / max(t_replay, 1e-9),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_replay.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
