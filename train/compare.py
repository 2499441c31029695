"""Stage compare: runs side by side, from run-directory manifests and local (offline) W&B runs.

``python -m train stage=compare runs=[runs/quickstart,runs/quickstart_orig]`` reads, for each entry:

- a run directory ``runs/<name>`` (its ``synth/``, ``features/``, ``train/``, ``eval/`` stage directories), or one
  stage directory: eval ``metrics.json`` (tau and speedup per method and source), train ``manifest.json``
  (tokens/s, steps, global batch, seconds), synth ``manifest.json`` (conversations, generated tokens);
- a W&B offline run directory (``wandb/offline-run-*``) or a directory holding some: its ``run-*.wandb`` log
  (config, history, summary), read without W&B's servers, for whatever the manifests do not hold.

It prints a table (rows: held-out tau per method and source, speedup, training tokens/s, budget; one column per
run) and writes ``compare.md``, ``compare.json`` and ``compare.png`` into its run directory atomically.
No W&B account is needed.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import Any

from eval.replay import describe_paired, paired_tau_diff
from train.atomic import atomic_write_json, atomic_write_text, atomic_write_with
from train.config import Config, ConfigError
from train.manifest import write_manifest

logger = logging.getLogger(__name__)
STAGE_DIRS = ("synth", "features", "train", "eval", "export")


# -- W&B offline runs ------------------------------------------------------------------------------------


def read_wandb_log(path: Path) -> dict[str, Any]:
    """Decode a W&B ``run-*.wandb`` file (a LevelDB-style record log of protobuf ``Record`` messages).

    Returns ``{"name", "group", "job_type", "config", "summary", "history": [{key: value}, ...]}``.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    block, header = 32768, 7
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run log")
    out: dict[str, Any] = {"name": None, "group": None, "job_type": None, "config": {}, "summary": {}, "history": []}
    pos, pending = header, b""

    def value(item: Any) -> tuple[str, Any]:
        key = item.key or "/".join(item.nested_key)
        try:
            return key, json.loads(item.value_json)
        except ValueError:
            return key, item.value_json

    while pos + header <= len(data):
        left = block - pos % block
        if left < header:  # block trailer padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + header])
        chunk = data[pos + header : pos + header + length]
        pos += header + length
        if kind == 0 and length == 0:
            continue
        if kind in (1, 2):  # full, first
            pending = chunk
        else:  # middle, last
            pending += chunk
        if kind not in (1, 4):
            continue
        rec = pb.Record()
        try:
            rec.ParseFromString(pending)
        except Exception:  # a truncated tail (a crashed run): keep what was read
            break
        which = rec.WhichOneof("record_type")
        if which == "run":
            out["name"], out["group"], out["job_type"] = rec.run.display_name, rec.run.run_group, rec.run.job_type
            for item in rec.run.config.update:
                k, v = value(item)
                out["config"][k] = v
        elif which == "config":
            for item in rec.config.update:
                k, v = value(item)
                out["config"][k] = v
        elif which == "history":
            out["history"].append(dict(value(i) for i in rec.history.item))
        elif which == "summary":
            for item in rec.summary.update:
                k, v = value(item)
                out["summary"][k] = v
    for row in out["history"]:  # the last value of every logged key, under what summary says
        for k, v in row.items():
            if not k.startswith("_"):
                out["summary"].setdefault(k, v)
    return out


def wandb_runs(path: Path) -> list[Path]:
    """The ``run-*.wandb`` logs under ``path`` (an offline run directory or a directory above some)."""
    if path.is_file() and path.suffix == ".wandb":
        return [path]
    return sorted(path.glob("run-*.wandb")) or sorted(path.glob("**/offline-run-*/run-*.wandb"))


# -- one run ------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _stage_dirs(path: Path) -> dict[str, Path]:
    """Map stage -> directory for a run directory, a stage directory, or a W&B run inside a stage directory."""
    if any((path / s).is_dir() for s in STAGE_DIRS):
        return {s: path / s for s in STAGE_DIRS if (path / s).is_dir()}
    manifest = _read_json(path / "manifest.json")
    if manifest and manifest.get("stage") in STAGE_DIRS:
        dirs = {manifest["stage"]: path}
        if path.parent.name not in ("", ".", "runs"):  # siblings of a stage directory belong to the same run
            for s in STAGE_DIRS:
                if s not in dirs and (path.parent / s / "manifest.json").is_file():
                    dirs[s] = path.parent / s
        return dirs
    return {}


def _label(path: Path) -> str:
    p = path.resolve()
    if p.name.startswith("offline-run-") or p.suffix == ".wandb":
        return p.parent.parent.parent.name if p.name.startswith("offline-run-") else p.parent.name
    if p.name in STAGE_DIRS or ((p / "manifest.json").is_file() and not any((p / s).is_dir() for s in STAGE_DIRS)):
        return f"{p.parent.name}/{p.name}"
    return p.name


def _from_wandb(run: dict[str, Any], into: dict[str, Any]) -> None:
    """Fill the fields a manifest would give from a W&B run's summary (eval keys: method/source/metric)."""
    s, job = run["summary"], run.get("job_type")
    if job == "eval" or any(k.endswith("/tau") for k in s):
        for key, v in s.items():
            parts = key.split("/")
            if len(parts) == 3 and parts[2] in ("tau", "speedup") and isinstance(v, int | float):
                into["eval"].setdefault(parts[0], {}).setdefault(parts[1], {}).setdefault(parts[2], v)
    if job == "train" or "train/tokens_per_s" in s:
        t = into["train"]
        t.setdefault("tokens_per_s", s.get("train/tokens_per_s"))
        steps = [row["_step"] for row in run["history"] if "_step" in row]
        t.setdefault("steps", max(steps) if steps else None)
        t.setdefault("best_tau", s.get("best_tau"))
        cfg = run["config"]
        tr = cfg.get("train", {}) if isinstance(cfg.get("train"), dict) else {}
        if tr and t.get("global_batch") is None:
            t["global_batch"] = tr.get("micro_batch_size", 0) * tr.get("grad_accum", 1)
        if tr and t.get("max_steps") is None:
            t["max_steps"] = tr.get("max_steps")


def load_run(entry: str) -> dict[str, Any]:
    """Everything compare shows about one run, from its manifests, then its W&B offline runs."""
    path = Path(entry).expanduser()
    if not path.exists():
        raise ConfigError(f"runs=[...]: {entry} does not exist (give runs/<name>, a stage dir or a W&B run dir)")
    run: dict[str, Any] = {"label": _label(path), "path": str(path), "eval": {}, "train": {}, "synth": {}}
    run["sources"] = []
    dirs = _stage_dirs(path)
    metrics = _read_json(dirs["eval"] / "metrics.json") if "eval" in dirs else None
    if metrics:
        for method, per in metrics["metrics"].items():
            for src, m in per.items():
                run["eval"].setdefault(method, {})[src] = {
                    "tau": m.get("tau"),
                    "tau_ci": m.get("tau_ci"),
                    "prompts": m.get("prompts"),
                    "speedup": m.get("speedup"),
                    "per_prompt": m.get("per_prompt"),
                }
        run["eval_prompts"] = metrics.get("num_prompts")
        run["sources"].append(str(dirs["eval"] / "metrics.json"))
    train = _read_json(dirs["train"] / "manifest.json") if "train" in dirs else None
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
            "tokens_per_s": res.get("train_tokens_per_second"),
            "supervised_tokens_per_s": res.get("supervised_tokens_per_second"),
            "tokens": round(res["train_tokens_per_second"] * res["seconds"])
            if res.get("train_tokens_per_second") and res.get("seconds")
            else None,
            "trainable_parameters": res.get("trainable_parameters"),
            "best_tau": (res.get("best") or {}).get("tau"),
            "lr": tcfg.get("lr"),
        }
        run["sources"].append(str(dirs["train"] / "manifest.json"))
    synth = _read_json(dirs["synth"] / "manifest.json") if "synth" in dirs else None
    if synth:
        counts, timings = synth.get("counts", {}), synth.get("timings", {})
        run["synth"] = {
            "conversations": counts.get("conversations"),
            "generated_tokens": counts.get("generated_tokens"),
            "regenerate": synth.get("config", {}).get("synth", {}).get("regenerate"),
            "generation_seconds": timings.get("generation_seconds"),
        }
        run["sources"].append(str(dirs["synth"] / "manifest.json"))
    logs = wandb_runs(path)
    if not logs:
        for d in dirs.values():
            logs += wandb_runs(d / "wandb")
    for log in logs:
        try:
            _from_wandb(read_wandb_log(log), run)
            run["sources"].append(str(log))
        except (ValueError, OSError) as exc:
            logger.warning("skipping W&B log %s: %s", log, exc)
    if not run["sources"]:
        raise ConfigError(f"runs=[...]: nothing to compare in {entry} (no eval/train/synth manifest, no W&B run)")
    return run


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
        ("trainable parameters", [_fmt(x.get("trainable_parameters")) for x in t]),
        ("synth conversations", [_fmt(x.get("conversations")) for x in y]),
        ("synth regenerated by target", [_fmt(x.get("regenerate")) for x in y]),
        ("synth generated tokens", [_fmt(x.get("generated_tokens")) for x in y]),
        ("eval prompts", [_fmt(r.get("eval_prompts")) for r in runs]),
    ]
    return [(label, cells) for label, cells in out if any(c not in ("-", "- / -") for c in cells)]


def markdown(runs: list[dict[str, Any]]) -> str:
    head = "| | " + " | ".join(r["label"] for r in runs) + " |"
    sep = "|---|" + "---|" * len(runs)
    return "\n".join([head, sep, *(f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows(runs))])


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(m, s) for r in runs for m, per in r["eval"].items() if m != "plain" for s in per})
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 0.9 * len(keys) + 6), 4.5), width_ratios=[3, 1])
    width = 0.8 / max(1, len(runs))
    for i, r in enumerate(runs):
        cells = [r["eval"].get(m, {}).get(s, {}) for m, s in keys]
        taus = [e.get("tau") or 0 for e in cells]
        cis = [_ci(e) for e in cells]
        err = [
            [t - c[0] if c else 0 for t, c in zip(taus, cis, strict=True)],
            [c[1] - t if c else 0 for t, c in zip(taus, cis, strict=True)],
        ]
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
        run_dir / "manifest.json",
        "compare",
        cfg,
        inputs={"runs": list(cfg.runs)},
        files={"table": "compare.md", "data": "compare.json", "plot": "compare.png"},
    )
    print(table)
    print(f"\nwritten: {run_dir / 'compare.md'}, {run_dir / 'compare.png'}")
    return {"runs": runs, "table": table}
