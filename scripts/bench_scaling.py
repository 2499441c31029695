"""Scaling study (issue 16): held-out tau against CPU time, for data volume, training steps and any other setting.

    python scripts/bench_scaling.py --base <runs>/cpu_1h [--experiment cpu_1h] [--name scaling] [--runs-root runs]
        [--fractions 0.25 0.5 1] [--steps 300 900] [--row LABEL=override,override ...]
        [--include LABEL=<runs>/other_run ...] [--reuse] [-- overrides for every trained row ...]

``<runs>`` is ``--runs-root`` (default ``$RUNS_ROOT``, else ``runs``, taken from the repository root), where the
trained rows and the study are written (every stage gets ``runs_root=<runs>``). ``--base`` must exist first: a run
with synth data and precomputed features, e.g. ``python -m train stage=all experiment=cpu_1h runs_root=<runs>``
(or ``stage=synth`` then ``stage=features`` with its ``run_name``); the script stops at once without them.

One finished run (``--base``: its ``synth/`` rows, precomputed ``features/`` and held-out split) is the data for
every row, so every row is judged on the *same* held-out prompts and the rows differ only in what they change:

- **the grid**: each ``--fractions`` x ``--steps`` pair trains the experiment's drafter on ``fraction`` of the base
  run's training rows, drawn at random with the run's seed (``train.max_rows``), for that many optimizer steps
  (``train.max_steps``), with the experiment's other settings (checks, weight average, ...);
- **``--row``**: extra rows trained on all the rows with the given overrides (e.g. ``--row eagle1=drafter=eagle``,
  ``--row lr3e-4=train.lr=3e-4``, ``--row ttt2=drafter.ttt_steps=2``);
- **``--include``**: drafters trained elsewhere *on the same synth rows* (e.g. the base run itself), judged here
  again on the same prompts; their CPU time is read from their own manifests.

Every row is replayed (``stage=eval eval.mode=replay``, chain K=5 and the 16-node tree, the experiment's held-out
sample), and compared with the reference row (``--reference``, default: the row with the most rows and steps) by the
paired bootstrap over prompts. Each row states its CPU time split: **synth** = the base run's generation seconds x
the share of its target-written tokens this row trains on; **features** = the base run's features seconds x the
share of its sequence tokens; **train** = the row's own training seconds (checks and saves included). The outputs,
``<runs>/<name>/scaling.json``, ``scaling.md`` and ``scaling.png`` (tau against CPU-hours), are written atomically.
Each step is a subprocess, run one after the other; ``--reuse`` keeps rows whose train and eval outputs exist.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_vs_peer import read_json, run  # noqa: E402  (one subprocess runner for the benchmark scripts)

logger = logging.getLogger("bench_scaling")


@dataclass
class Row:
    label: str
    run_dir: Path
    overrides: list[str] = field(default_factory=list)
    included: bool = False


def parse_pair(text: str, what: str) -> tuple[str, str]:
    label, sep, rest = text.partition("=")
    if not sep or not label or not rest:
        raise SystemExit(f"{what} takes LABEL=VALUE, got {text!r}")
    return label, rest


def token_counts(synth_dir: Path, max_seq_len: int) -> tuple[list[int], list[int]]:
    """Per training row, in training order: sequence tokens and target-written (supervised) tokens."""
    from train.batches import load_rows

    rows = load_rows(synth_dir, max_seq_len)
    return [len(r.input_ids) for r in rows], [int(sum(r.loss_mask)) for r in rows]


def finished(path: Path) -> bool:
    return path.is_file() and bool(read_json(path).get("result", {}).get("finished"))


def method_key(metrics: dict[str, Any], kind: str) -> str | None:
    keys = sorted(k for k in metrics if f"_{kind}_" in k and not k.startswith("prompt_lookup"))
    return keys[0] if keys else None


def row_summary(row: Row, base: dict[str, Any], seq: list[int], sup: list[int]) -> dict[str, Any]:
    """Tau, intervals and the CPU-time split of one row."""
    manifest = read_json(row.run_dir / "train" / "manifest.json")
    metrics = read_json(row.run_dir / "eval" / "metrics.json")["metrics"]
    from train.loop import subset_rows

    t = manifest["config"]["train"]
    n = t.get("max_rows") or len(seq)
    ids = subset_rows(len(seq), n, int(manifest["config"]["seed"])) if t.get("max_rows") else range(len(seq))
    row_sup, row_seq = sum(sup[i] for i in ids), sum(seq[i] for i in ids)
    share_sup, share_seq = row_sup / sum(sup), row_seq / sum(seq)
    synth_s = base["synth_seconds"] * share_sup
    feat_s = base["features_seconds"] * share_seq if t.get("features") == "precomputed" else 0.0
    train_s = float(manifest["result"]["seconds"])
    out: dict[str, Any] = {
        "label": row.label,
        "run_dir": str(row.run_dir),
        "included": row.included,
        "overrides": row.overrides,
        "drafter": manifest["config"]["drafter"]["name"],
        "rows": n,
        "target_tokens": row_sup,
        "steps": int(manifest["result"]["steps"]),
        "epochs": round(int(manifest["result"]["steps"]) * int(t["micro_batch_size"]) * int(t["grad_accum"]) / n, 2),
        "seconds": {"synth": round(synth_s, 1), "features": round(feat_s, 1), "train": round(train_s, 1)},
        "cpu_hours": round((synth_s + feat_s + train_s) / 3600, 3),
        "best_check": manifest["result"].get("best"),
        "tau": {},
    }
    for kind in ("chain", "tree"):
        key = method_key(metrics, kind)
        if key is None:
            continue
        out["tau"][kind] = {
            "method": key,
            **{
                src: {k: r.get(k) for k in ("tau", "tau_ci", "prompts", "per_prompt")}
                for src, r in metrics[key].items()
            },
        }
    return out


def add_paired(rows: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    from eval.stats import paired_tau_diff

    for r in rows:
        r["paired_vs_reference"] = {}
        for kind in ("chain", "tree"):
            if kind in r["tau"] and kind in ref["tau"] and r is not ref:
                r["paired_vs_reference"][kind] = paired_tau_diff(
                    ref["tau"][kind]["all"]["per_prompt"], r["tau"][kind]["all"]["per_prompt"]
                )


def fmt_tau(t: dict[str, Any] | None, src: str) -> str:
    if not t or src not in t:
        return "-"
    r = t[src]
    ci = r.get("tau_ci") or [math.nan, math.nan]
    return f"{r['tau']:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]"


def markdown(s: dict[str, Any]) -> str:
    from data.tables import table
    from eval.stats import describe_paired

    sources = s["sources"]
    head = ["row", "drafter", "rows", "target tokens", "steps", "epochs", "synth / features / train min", "CPU-h"]
    head += [f"chain K=5 {src}" for src in sources] + ["tree all", "paired vs reference: chain / tree"]
    lines = [
        f"# Scaling study: {s['name']}",
        "",
        f"Base run `{s['base']}` ({s['base_rows']} training rows, {s['base_target_tokens']} target-written tokens), "
        f"held-out prompts as its eval; reference row `{s['reference']}`. CPU time: synth and features scaled from "
        "the base run's stage times by the share of tokens each row uses; train is the row's own.",
        "",
    ]
    rows = []
    for r in s["rows"]:
        sec = r["seconds"]
        chain, tree = r["tau"].get("chain"), r["tau"].get("tree")
        p = r.get("paired_vs_reference", {})
        paired = (
            "reference"
            if r["label"] == s["reference"]
            else (f"{describe_paired(p.get('chain'))} / {describe_paired(p.get('tree'))}")
        )
        cells = [
            r["label"], r["drafter"], str(r["rows"]), str(r["target_tokens"]), str(r["steps"]), f"{r['epochs']:.1f}",
            f"{sec['synth'] / 60:.1f} / {sec['features'] / 60:.1f} / {sec['train'] / 60:.1f}", f"{r['cpu_hours']:.2f}",
            *[fmt_tau(chain, src) for src in sources], fmt_tau(tree, "all"), paired,
        ]  # fmt: skip
        rows.append(cells)
    return "\n".join(lines + table(head, rows)) + "\n"


def plot(s: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind, marker in (("chain", "o"), ("tree", "s")):
        xs, ys, lo, hi, labels = [], [], [], [], []
        for r in s["rows"]:
            t = r["tau"].get(kind, {}).get("all")
            if not t:
                continue
            ci = t.get("tau_ci") or [t["tau"], t["tau"]]
            xs.append(r["cpu_hours"])
            ys.append(t["tau"])
            lo.append(t["tau"] - ci[0])
            hi.append(ci[1] - t["tau"])
            labels.append(r["label"])
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt=marker, capsize=3, label=f"{kind} (all held-out prompts)")
        for x, y, lab in zip(xs, ys, labels, strict=True):
            ax.annotate(lab, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("CPU time of the row (hours: synth + features + train)")
    ax.set_ylabel("held-out tau (replay, 95% interval)")
    ax.set_title(f"Scaling study {s['name']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="a finished run with synth/, features/ (precomputed) and eval")
    ap.add_argument("--experiment", default="cpu_1h", help="the settings every trained row starts from")
    ap.add_argument("--name", default="scaling", help="output <runs>/<name>; trained rows are <runs>/<name>_<label>")
    ap.add_argument("--fractions", type=float, nargs="*", default=[0.25, 0.5, 1.0])
    ap.add_argument("--steps", type=int, nargs="*", default=[300])
    ap.add_argument("--row", action="append", default=[], help="LABEL=override,override (all rows)")
    ap.add_argument("--include", action="append", default=[], help="LABEL=run_dir trained on the base's rows")
    ap.add_argument("--reference", default=None, help="label of the row the others are paired against")
    ap.add_argument("--reuse", action="store_true", help="keep rows whose train and eval outputs exist")
    ap.add_argument(
        "--runs-root",
        default=str(REPO / os.environ.get("RUNS_ROOT", "runs")),
        help="<runs>, where the rows and the study are written (default $RUNS_ROOT under the repository, else runs)",
    )
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    args = ap.parse_args(argv)
    if any(not 0 < f <= 1 for f in args.fractions) or any(s < 1 for s in args.steps):
        ap.error("--fractions in (0, 1] and --steps >= 1")
    return args, extra


def main() -> None:
    args, common_overrides = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    base_dir = Path(args.base).resolve()
    synth_dir, features_dir = base_dir / "synth", base_dir / "features"
    for p in (synth_dir / "manifest.json", features_dir / "manifest.json"):
        if not p.is_file():
            raise SystemExit(
                f"{p} not found: --base must be a run with synth and precomputed features (made by python -m train "
                f"stage=synth, then stage=features, with its run_name and runs_root)"
            )
    synth_m, feat_m = read_json(synth_dir / "manifest.json"), read_json(features_dir / "manifest.json")
    max_seq_len = int(feat_m["max_seq_len"])
    seq, sup = token_counts(synth_dir, max_seq_len)
    base = {
        "synth_seconds": float(synth_m["timings"].get("stage_seconds") or synth_m["timings"]["generation_seconds"]),
        "features_seconds": float(feat_m["timings"]["seconds"]),
    }
    if base["features_seconds"] <= 0:
        logger.warning("the base run's features manifest has no time (reused features): features minutes show 0")

    runs_root = Path(args.runs_root).resolve()
    rows: list[Row] = []
    for steps in args.steps:
        for frac in args.fractions:
            n = max(1, round(frac * len(seq)))
            label = f"rows{n}_steps{steps}"
            rows.append(Row(label, runs_root / f"{args.name}_{label}",
                            [f"train.max_rows={n}", f"train.max_steps={steps}"]))  # fmt: skip
    for spec in args.row:
        label, rest = parse_pair(spec, "--row")
        rows.append(Row(label, runs_root / f"{args.name}_{label}", rest.split(",")))
    for spec in args.include:
        label, rest = parse_pair(spec, "--include")
        rows.append(Row(label, Path(rest).resolve(), included=True))

    py = sys.executable
    common = [f"experiment={args.experiment}", f"synth_dir={synth_dir}", "wandb.mode=disabled", *common_overrides]
    logs = runs_root / args.name / "logs"
    for row in rows:
        if not row.included:
            manifest = row.run_dir / "train" / "manifest.json"
            if not (args.reuse and finished(manifest)):
                train = [f"runs_root={runs_root}", f"run_name={row.run_dir.name}", f"train.features_dir={features_dir}"]
                train.append("train.features=precomputed")
                run([py, "-m", "train", "stage=train", *common, *train, "overwrite=true", *row.overrides],
                    logs / f"{row.label}_train.log")  # fmt: skip
        elif not finished(row.run_dir / "train" / "manifest.json"):
            raise SystemExit(f"--include {row.label}: {row.run_dir} has no finished training")
        metrics = row.run_dir / "eval" / "metrics.json"
        if not (args.reuse and metrics.is_file()):
            eval_run = [f"runs_root={row.run_dir.parent.resolve()}", f"run_name={row.run_dir.name}"]
            run([py, "-m", "train", "stage=eval", *common, *eval_run, "eval.mode=replay", "eval.proposers=[drafter]",
                 "overwrite=true"], logs / f"{row.label}_eval.log")  # fmt: skip

    summaries = [row_summary(r, base, seq, sup) for r in rows]
    ref_label = args.reference or max(summaries, key=lambda r: (r["rows"], r["steps"]))["label"]
    ref = next((r for r in summaries if r["label"] == ref_label), None)
    if ref is None:
        raise SystemExit(f"--reference {ref_label}: no such row")
    add_paired(summaries, ref)
    sources = [k for k in (summaries[0]["tau"].get("chain") or {}) if k not in ("method", "all")] + ["all"]
    study = {
        "name": args.name,
        "command": [py, *sys.argv],
        "base": str(base_dir),
        "base_rows": len(seq),
        "base_target_tokens": sum(sup),
        "base_seconds": base,
        "reference": ref_label,
        "sources": sources,
        "rows": summaries,
    }
    from data.atomic import atomic_write_json, atomic_write_text

    out = runs_root / args.name
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "scaling.json", study)
    text = markdown(study)
    atomic_write_text(out / "scaling.md", text)
    plot(study, out / "scaling.png")
    print(text)


if __name__ == "__main__":
    main()
