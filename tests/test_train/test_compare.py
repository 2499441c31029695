"""stage=compare on eval outputs: tau with its 95% interval, and whether runs differ beyond their intervals."""

from __future__ import annotations

import json
from pathlib import Path

from train.compare import differs, load_run, markdown


def _eval_dir(root: Path, name: str, tau: float, lo: float, hi: float) -> Path:
    d = root / name / "eval"
    d.mkdir(parents=True)
    m = {"tau": tau, "tau_ci": [lo, hi], "prompts": 24, "speedup": 0.9}
    metrics = {"num_prompts": 24, "metrics": {"eagle_chain_k5": {"sharegpt": m, "all": m}}}
    (d / "metrics.json").write_text(json.dumps(metrics))
    return root / name


def test_compare_reports_intervals_and_whether_runs_differ(tmp_path: Path) -> None:
    a = load_run(str(_eval_dir(tmp_path, "a", 1.50, 1.45, 1.55)))
    b = load_run(str(_eval_dir(tmp_path, "b", 1.70, 1.62, 1.78)))
    c = load_run(str(_eval_dir(tmp_path, "c", 1.53, 1.48, 1.60)))
    table = markdown([a, b, c])
    assert "1.50 [1.45, 1.55]" in table and "1.70 [1.62, 1.78]" in table
    row = next(line for line in table.splitlines() if line.startswith("| vs a: eagle_chain_k5 [all]"))
    assert row.split("|")[2:5] == [" baseline ", " higher ", " within intervals "]
    assert differs(b["eval"]["eagle_chain_k5"]["all"], a["eval"]["eagle_chain_k5"]["all"]) == "lower"
    assert differs({"tau": 1.5}, a["eval"]["eagle_chain_k5"]["all"]) == "-"  # an old run without an interval
