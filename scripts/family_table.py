"""The drafter families side by side, from the run directories that scripts/bench_family.sh wrote.

    python scripts/family_table.py quickstart          # <runs>/quickstart_{eagle,eagle3,medusa,standalone}
    python scripts/family_table.py cpu_1h              # eagle3 from <runs>/cpu_1h when <runs>/cpu_1h_eagle3 is absent
    python scripts/family_table.py quickstart --runs-root /data/runs

``<runs>`` is ``--runs-root`` (default ``$RUNS_ROOT``, else ``runs``). Reads only: each family's row comes from
``RUNS_ROOT=<runs> bash scripts/bench_family.sh <family> <experiment>``, and a family without one is a
``(no run in ...)`` row.

Prints a Markdown table: held-out tau per source (chain K and each family's default tree), wall-clock speedup
over plain decoding and the draft cost ratio c (both measured in the same eval process), training tokens/s,
trainable parameters and the size of the saved drafter directory. Prompt lookup is the floor row.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

FAMILIES = ("eagle", "eagle3", "medusa", "standalone")


def _size_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


def _family(run: Path) -> str | None:
    """The drafter family a run trained (its train manifest), None without one."""
    manifest = run / "train" / "manifest.json"
    if not manifest.is_file():
        return None
    return json.loads(manifest.read_text())["config"]["drafter"].get("name")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", nargs="?", default="quickstart")
    ap.add_argument("--runs-root", default=os.environ.get("RUNS_ROOT", "runs"), help="default $RUNS_ROOT, else runs")
    args = ap.parse_args()
    exp, runs = args.experiment, Path(args.runs_root)
    head = (
        "| family | decode | tau ShareGPT | tau HumanEval | tau all | speedup all | c | "
        "train tok/s | trainable params | best/ size |"
    )
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    floor = None
    for fam in FAMILIES:
        run = runs / f"{exp}_{fam}"
        if not run.is_dir() and _family(runs / exp) == fam:  # `stage=all experiment=<exp>`'s own run
            run = runs / exp
        if not (run / "eval" / "metrics.json").is_file():
            print(f"| {fam} | (no run in {run}) | | | | | | | | |")
            continue
        metrics = json.loads((run / "eval" / "metrics.json").read_text())["metrics"]
        train = json.loads((run / "train" / "manifest.json").read_text())["result"]
        size = _size_mb(run / "train" / "best")
        for name, m in metrics.items():
            if name == "plain":
                continue
            if name.startswith("prompt_lookup"):
                floor = floor or (name, m)
                continue
            decode = name.split("_", 1)[1]
            tau = " | ".join(f"{m[s]['tau']:.2f}" for s in ("sharegpt", "humaneval", "all"))
            params = train["trainable_parameters"] / 1e6
            print(
                f"| {fam} | {decode} | {tau} | {m['all']['speedup']:.2f}x | {m['all']['draft_cost_ratio_c']:.3f} "
                f"| {train['train_tokens_per_second']:.0f} | {params:.2f}M | {size:.0f} MB |"
            )
    if floor:
        name, m = floor
        print(
            f"| prompt lookup | {name.split('_', 2)[-1]} | {m['sharegpt']['tau']:.2f} | {m['humaneval']['tau']:.2f} "
            f"| {m['all']['tau']:.2f} | {m['all']['speedup']:.2f}x | 0 | - | - | - |"
        )


if __name__ == "__main__":
    main()
