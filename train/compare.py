"""Stage compare: runs side by side, from the manifests and metrics files the stages write.

``python -m train stage=compare runs=[runs/quickstart,runs/quickstart_orig]`` reads, for each entry:

- a run directory ``runs/<name>`` (its ``synth/``, ``features/``, ``train/``, ``eval/`` stage directories), or one
  stage directory: eval ``metrics.json`` (tau and speedup per method and source), train ``manifest.json``
  (tokens/s, steps, global batch, seconds), synth ``manifest.json`` (conversations, generated tokens);
- a W&B offline run directory (``<stage dir>/wandb/offline-run-*``), its ``run-*.wandb`` file or the ``wandb/``
  folder: the stage directory that wrote it, read as above.

Everything comes from the project's own files (manifests and ``metrics.json`` hold every figure shown); W&B's
run files are a private binary format, never decoded here: look at curves in W&B itself (``wandb sync`` uploads
an offline run).

It prints a table (rows: held-out tau per method and source, speedup, training tokens/s, budget; one column per
run) and writes ``compare.md``, ``compare.json`` and ``compare.png`` into its run directory atomically.
No W&B account is needed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from data.atomic import atomic_write_json, atomic_write_text, atomic_write_with
from data.config import ConfigError
from data.layout import MANIFEST, METRICS
from data.manifest import write_manifest
from data.tables import table
from eval.stats import describe_paired, paired_tau_diff
from train.config import Config

logger = logging.getLogger(__name__)
STAGE_DIRS = ("synth", "features", "train", "eval", "export")


# -- W&B offline runs ------------------------------------------------------------------------------------


def stage_dir_of_wandb(path: Path) -> Path | None:
    """The stage directory that wrote a W&B offline run (given as ``run-*.wandb``, ``offline-run-*`` or the
    ``wandb/`` folder inside the stage directory), or None when ``path`` is none of these."""
    p = path.resolve()
    if p.is_file() and p.suffix == ".wandb":
        p = p.parent
    if p.name.startswith(("offline-run-", "run-")) and p.parent.name == "wandb":
        p = p.parent
    return p.parent if p.name == "wandb" and p.is_dir() else None


# -- one run ------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _stage_dirs(path: Path) -> dict[str, Path]:
    """Map stage -> directory for a run directory, a stage directory, or a W&B run inside a stage directory."""
    if any((path / s).is_dir() for s in STAGE_DIRS):
        return {s: path / s for s in STAGE_DIRS if (path / s).is_dir()}
    manifest = _read_json(path / MANIFEST)
    if manifest and manifest.get("stage") in STAGE_DIRS:
        dirs = {manifest["stage"]: path}
        if path.parent.name not in ("", ".", "runs"):  # siblings of a stage directory belong to the same run
            for s in STAGE_DIRS:
                if s not in dirs and (path.parent / s / MANIFEST).is_file():
                    dirs[s] = path.parent / s
        return dirs
    return {}


def _label(path: Path) -> str:
    p = path.resolve()
    if p.name.startswith("offline-run-") or p.suffix == ".wandb":
        return p.parent.parent.parent.name if p.name.startswith("offline-run-") else p.parent.name
    if p.name in STAGE_DIRS or ((p / MANIFEST).is_file() and not any((p / s).is_dir() for s in STAGE_DIRS)):
        return f"{p.parent.name}/{p.name}"
    return p.name


def load_run(entry: str) -> dict[str, Any]:
    """Everything compare shows about one run, from its stage directories' manifests and eval metrics."""
    path = Path(entry).expanduser()
    if not path.exists():
        raise ConfigError(f"runs=[...]: {entry} does not exist (give runs/<name>, a stage dir or a W&B run dir)")
    run: dict[str, Any] = {
        "label": _label(path),
        "path": str(path),
        "eval": {},
        "train": {},
        "synth": {},
        "features": {},
    }
    run["sources"] = []
    dirs = _stage_dirs(stage_dir_of_wandb(path) or path)
    metrics = _read_json(dirs["eval"] / METRICS) if "eval" in dirs else None
    if metrics:
        # a method judged sampled is its own row ("eagle3_chain_k5@T1"): never paired with a greedy judgement
        temp = float((metrics.get("settings") or {}).get("temperature") or 0)

        def label(method: str, t: float) -> str:
            return method if t == 0 else f"{method}@T{t:g}"

        for method, per in metrics["metrics"].items():
            for src, m in per.items():
                run["eval"].setdefault(label(method, temp), {})[src] = {
                    "tau": m.get("tau"),
                    "tau_ci": m.get("tau_ci"),
                    "prompts": m.get("prompts"),
                    "speedup": m.get("speedup"),
                    "per_prompt": m.get("per_prompt"),
                }
                for kind, tag in (("by_context", "ctx"), ("by_turn", "turn")):  # rows per bucket / turn, if several
                    groups = m.get(kind) or {}
                    for g_label, g in groups.items() if len(groups) > 1 else ():
                        run["eval"].setdefault(label(method, temp), {})[f"{src} {tag} {g_label}"] = {
                            k: g.get(k) for k in ("tau", "tau_ci", "prompts", "per_prompt")
                        }
                for t, bt in (m.get("by_temperature") or {}).items():  # eval.temperatures: one row per temperature
                    if float(t) != temp:
                        run["eval"].setdefault(label(method, float(t)), {})[src] = {
                            "tau": bt.get("tau"),
                            "tau_ci": bt.get("tau_ci"),
                            "prompts": bt.get("prompts"),
                            "per_prompt": bt.get("per_prompt"),
                        }
        run["eval_prompts"] = metrics.get("num_prompts")
        run["sources"].append(str(dirs["eval"] / METRICS))
    train = _read_json(dirs["train"] / MANIFEST) if "train" in dirs else None
    if train:
        res, tcfg = train.get("result", {}), train.get("config", {}).get("train", {})
        world = res.get("world_size", 1)
        drafter = train.get("config", {}).get("drafter") or {}
        run["train"] = {
            "drafter": drafter.get("name"),
            "steps": res.get("steps"),
            "max_steps": tcfg.get("max_steps"),
            "global_batch": tcfg.get("micro_batch_size", 0) * tcfg.get("grad_accum", 1) * world,
            "world_size": world,
            "seconds": res.get("seconds"),
            "segments": res.get("segments"),
            "tokens_per_s": res.get("train_tokens_per_second"),
            "supervised_tokens_per_s": res.get("supervised_tokens_per_second"),
            "tokens": round(res["train_tokens_per_second"] * res["seconds"])
            if res.get("train_tokens_per_second") and res.get("seconds")
            else None,
            "trainable_parameters": res.get("trainable_parameters"),
            "best_tau": (res.get("best") or {}).get("tau"),
            "lr": tcfg.get("lr"),
        }
        run["sources"].append(str(dirs["train"] / MANIFEST))
    tconf = (train or {}).get("config", {})
    precomputed = tconf.get("train", {}).get("features", "precomputed") == "precomputed"
    if not precomputed:
        dirs.pop("features", None)  # trained online: features made for something else cost this drafter nothing
    for stage, named in (("synth", tconf.get("synth_dir")), ("features", tconf.get("train", {}).get("features_dir"))):
        if stage not in dirs and named and (stage == "synth" or precomputed) and (Path(named) / MANIFEST).is_file():
            dirs[stage] = Path(named)  # an input shared from another run: it still cost this drafter its time
    synth = _read_json(dirs["synth"] / MANIFEST) if "synth" in dirs else None
    if synth:
        counts, timings = synth.get("counts", {}), synth.get("timings", {})
        run["synth"] = {
            "conversations": counts.get("conversations"),
            "generated_tokens": counts.get("generated_tokens"),
            "regenerate": synth.get("config", {}).get("synth", {}).get("regenerate"),
            "generation_seconds": timings.get("generation_seconds"),
            "seconds": timings.get("stage_seconds"),
        }
        run["sources"].append(str(dirs["synth"] / MANIFEST))
    features = _read_json(dirs["features"] / MANIFEST) if "features" in dirs else None
    if features:
        run["features"] = {"seconds": (features.get("timings") or {}).get("seconds")}
        run["sources"].append(str(dirs["features"] / MANIFEST))
    run["budget_hours"] = budget_hours(run)
    if not run["sources"]:
        raise ConfigError(f"runs=[...]: nothing to compare in {entry} (no eval metrics.json, no train/synth manifest)")
    return run


def budget_hours(run: dict[str, Any]) -> float | None:
    """Hours of machine time that made the drafter: the wall time of stage synth (engine start included), stage
    features (when the drafter trained on precomputed features) and stage train, times training's processes for
    the train stage. The x axis of a scaling study (tau per machine-hour). None without a train manifest; a stage
    whose manifest is missing (e.g. data made elsewhere) counts as zero, so such a run shows its training cost only.
    """
    t = run.get("train") or {}
    if not t.get("seconds"):
        return None
    segments = t.get("segments")  # every process segment of a resumed run, each with its own process count
    if segments:
        seconds = sum(float(s["seconds"]) * int(s.get("world_size") or 1) for s in segments)
    else:
        seconds = float(t["seconds"]) * int(t.get("world_size") or 1)
    seconds += float((run.get("synth") or {}).get("seconds") or 0.0)
    seconds += float((run.get("features") or {}).get("seconds") or 0.0)
    return seconds / 3600.0


# -- the table ----------------------------------------------------------------------------------------------


def _fmt(v: Any, spec: str = ".2f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def _ci(e: dict[str, Any]) -> tuple[float, float] | None:
    ci = e.get("tau_ci")
    if not ci or len(ci) != 2 or any(v is None or v != v for v in ci):  # missing or NaN
        return None
    return float(ci[0]), float(ci[1])


def _tau_cell(e: dict[str, Any]) -> str:
    tau, ci = e.get("tau"), _ci(e)
    if tau is None:
        return "-"
    return f"{tau:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else f"{tau:.2f}"


def differs(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Whether tau of ``b`` differs from ``a`` beyond their 95% intervals (non-overlapping intervals: a
    conservative test), as ``higher`` / ``lower`` / ``within intervals``; ``-`` when an interval is missing.
    Runs judged on the same prompts also get the sharper paired test (``paired tau diff`` rows)."""
    ca, cb = _ci(a), _ci(b)
    if ca is None or cb is None:
        return "-"
    if cb[0] > ca[1]:
        return "higher"
    if cb[1] < ca[0]:
        return "lower"
    return "within intervals"


def rows(runs: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """(row label, one cell per run): tau [95% interval] per method and source, whether each run's tau differs
    from the first run's beyond the intervals, speedup, then training and budget."""
    methods = sorted({m for r in runs for m in r["eval"] if m != "plain"})
    sources = sorted({s for r in runs for per in r["eval"].values() for s in per if s != "all"})
    out: list[tuple[str, list[str]]] = []
    for m in methods:
        for s in [*sources, "all"]:
            cells = [r["eval"].get(m, {}).get(s, {}) for r in runs]
            out.append((f"tau {m} [{s}]", [_tau_cell(e) for e in cells]))
            if len(runs) > 1:
                verdicts = ["baseline", *(differs(cells[0], e) for e in cells[1:])]
                if any(v not in ("-", "baseline") for v in verdicts):
                    out.append((f"vs {runs[0]['label']}: {m} [{s}]", verdicts))
                paired = [
                    describe_paired(paired_tau_diff(cells[0].get("per_prompt") or {}, e.get("per_prompt") or {}))
                    for e in cells[1:]
                ]
                if any(v != "-" for v in paired):
                    out.append((f"paired tau diff vs {runs[0]['label']}: {m} [{s}]", ["baseline", *paired]))
        out.append(
            (f"speedup {m} [all]", [_fmt(r["eval"].get(m, {}).get("all", {}).get("speedup"), ".2f") for r in runs])
        )
    t = [r["train"] for r in runs]
    y = [r["synth"] for r in runs]
    out += [
        ("drafter", [_fmt(x.get("drafter")) for x in t]),
        ("best held-out tau (train)", [_fmt(x.get("best_tau")) for x in t]),
        ("training tokens/s", [_fmt(x.get("tokens_per_s"), ".0f") for x in t]),
        ("supervised tokens/s", [_fmt(x.get("supervised_tokens_per_s"), ".0f") for x in t]),
        ("steps (of max)", [f"{_fmt(x.get('steps'))} / {_fmt(x.get('max_steps'))}" for x in t]),
        ("global batch (sequences)", [_fmt(x.get("global_batch")) for x in t]),
        ("processes", [_fmt(x.get("world_size")) for x in t]),
        ("training tokens", [_fmt(x.get("tokens")) for x in t]),
        ("training seconds", [_fmt(x.get("seconds"), ".0f") for x in t]),
        ("synth seconds (stage)", [_fmt(x.get("seconds"), ".0f") for x in y]),
        ("features seconds", [_fmt(r["features"].get("seconds"), ".0f") for r in runs]),
        ("budget hours (synth + features + train)", [_fmt(r.get("budget_hours"), ".2f") for r in runs]),
        ("trainable parameters", [_fmt(x.get("trainable_parameters")) for x in t]),
        ("synth conversations", [_fmt(x.get("conversations")) for x in y]),
        ("synth regenerated by target", [_fmt(x.get("regenerate")) for x in y]),
        ("synth generated tokens", [_fmt(x.get("generated_tokens")) for x in y]),
        ("eval prompts", [_fmt(r.get("eval_prompts")) for r in runs]),
    ]
    return [(label, cells) for label, cells in out if any(c not in ("-", "- / -") for c in cells)]


def markdown(runs: list[dict[str, Any]]) -> str:
    return "\n".join(table(["", *(r["label"] for r in runs)], ([label, *cells] for label, cells in rows(runs))))


def _yerr(taus: list[float], cis: list[tuple[float, float] | None]) -> list[list[float]]:
    """matplotlib's asymmetric error bars (below, above) from 95% intervals; none where an interval is missing."""
    return [
        [t - c[0] if c else 0 for t, c in zip(taus, cis, strict=True)],
        [c[1] - t if c else 0 for t, c in zip(taus, cis, strict=True)],
    ]


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(m, s) for r in runs for m, per in r["eval"].items() if m != "plain" for s in per})
    scaling = any(r.get("budget_hours") and r["eval"] for r in runs)
    ratios = [3, 1, 2] if scaling else [3, 1]
    fig, axes = plt.subplots(
        1, len(ratios), figsize=(max(8, 0.9 * len(keys) + 6) + (5 if scaling else 0), 4.5), width_ratios=ratios
    )
    width = 0.8 / max(1, len(runs))
    for i, r in enumerate(runs):
        cells = [r["eval"].get(m, {}).get(s, {}) for m, s in keys]
        taus = [e.get("tau") or 0 for e in cells]
        cis = [_ci(e) for e in cells]
        err = _yerr(taus, cis)
        axes[0].bar([k + i * width for k in range(len(keys))], taus, width, label=r["label"], yerr=err, capsize=2)
    axes[0].set_xticks([k + 0.4 - width / 2 for k in range(len(keys))], [f"{m}\n{s}" for m, s in keys], fontsize=7)
    axes[0].set_ylabel("held-out tau (tokens per target forward)")
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].legend(fontsize=8)
    if not keys:
        axes[0].text(0.5, 0.5, "no eval metrics", ha="center", transform=axes[0].transAxes)
    tps = [r["train"].get("tokens_per_s") or 0 for r in runs]
    axes[1].bar(range(len(runs)), tps, color=[f"C{i}" for i in range(len(runs))])
    axes[1].set_xticks(range(len(runs)), [r["label"] for r in runs], fontsize=7, rotation=20)
    axes[1].set_ylabel("training tokens/s")
    if scaling:  # the scaling view: overall tau of each method against the machine-hours that made the drafter
        for j, m in enumerate(sorted({m for m, _ in keys})):
            pts = [
                (r["budget_hours"], r["eval"][m]["all"])
                for r in runs
                if r.get("budget_hours") and "all" in r["eval"].get(m, {})
            ]
            if not pts:
                continue
            pts.sort(key=lambda p: p[0])
            xs, es = [p[0] for p in pts], [p[1] for p in pts]
            ys = [e.get("tau") or 0 for e in es]
            cis = [_ci(e) for e in es]
            axes[2].errorbar(xs, ys, yerr=_yerr(ys, cis), marker="o", capsize=2, label=m, color=f"C{j}")
        axes[2].set_xlabel("machine-hours (synth + features + train)")
        axes[2].set_ylabel("held-out tau, all sources")
        axes[2].legend(fontsize=7)
    fig.suptitle("draftsmith compare")
    fig.tight_layout()
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


def run_compare(cfg: Config, run_dir: Path) -> dict[str, Any]:
    if len(cfg.runs) < 1:
        raise ConfigError("stage=compare needs runs=[runs/<a>,runs/<b>] (run dirs, stage dirs or W&B run dirs)")
    runs = [load_run(r) for r in cfg.runs]
    table = markdown(runs)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "compare.md", table + "\n")
    atomic_write_json(run_dir / "compare.json", {"runs": runs})
    plot(runs, run_dir / "compare.png")
    write_manifest(
        run_dir / MANIFEST,
        "compare",
        cfg,
        inputs={"runs": list(cfg.runs)},
        files={"table": "compare.md", "data": "compare.json", "plot": "compare.png"},
    )
    print(table)
    print(f"\nwritten: {run_dir / 'compare.md'}, {run_dir / 'compare.png'}")
    return {"runs": runs, "table": table}
