"""stage=compare on eval outputs: tau with its 95% interval, and whether runs differ beyond their intervals."""

from __future__ import annotations

import json
from pathlib import Path

from tests import cli
from train.compare import differs, load_run, markdown


def _eval_dir(root: Path, name: str, tau: float, lo: float, hi: float, per_prompt: dict | None = None) -> Path:
    d = root / name / "eval"
    d.mkdir(parents=True)
    m = {"tau": tau, "tau_ci": [lo, hi], "prompts": 24, "speedup": 0.9}
    if per_prompt is not None:
        m["per_prompt"] = per_prompt
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


def test_compare_pairs_runs_judged_on_the_same_prompts(tmp_path: Path) -> None:
    ids = [f"sharegpt:{i}" for i in range(24)]
    base = [30 + 2 * i for i in range(24)]  # prompts differ a lot ...
    a = load_run(str(_eval_dir(tmp_path, "a", 1.5, 1.3, 1.7, {"ids": ids, "emitted": base, "steps": [20] * 24})))
    better = {"ids": ids, "emitted": [e + 2 for e in base], "steps": [20] * 24}  # ... b is better on every one
    b = load_run(str(_eval_dir(tmp_path, "b", 1.6, 1.4, 1.8, better)))
    table = markdown([a, b])
    row = next(line for line in table.splitlines() if line.startswith("| paired tau diff vs a: eagle_chain_k5 [all]"))
    assert "+0.100 [+0.100, +0.100], 24 better / 0 worse of 24" in row
    assert "| vs a: eagle_chain_k5 [all]" in table and "within intervals" in table  # the separate intervals overlap


def test_compare_keeps_each_temperature_in_its_own_rows(tmp_path: Path) -> None:
    """A run judged sampled (eval.temperature=1) and eval.temperatures' columns are rows of their own
    ("method@T1"): a sampled tau is never set against, or paired with, a greedy one."""
    ids = [f"sharegpt:{i}" for i in range(24)]
    pp = {"ids": ids, "emitted": [40] * 24, "steps": [20] * 24}
    greedy = load_run(str(_eval_dir(tmp_path, "greedy", 2.0, 1.9, 2.1, pp)))
    d = _eval_dir(tmp_path, "sampled", 1.6, 1.5, 1.7, {**pp, "emitted": [32] * 24}) / "eval"
    metrics = json.loads((d / "metrics.json").read_text())
    metrics["settings"] = {"temperature": 1.0}
    for m in metrics["metrics"]["eagle_chain_k5"].values():
        m["by_temperature"] = {
            "0": {"tau": 2.1, "tau_ci": [2.0, 2.2], "prompts": 24, "per_prompt": {**pp, "emitted": [42] * 24}},
            "1": {"tau": 1.6, "tau_ci": [1.5, 1.7], "prompts": 24, "per_prompt": pp},
        }
    (d / "metrics.json").write_text(json.dumps(metrics))
    sampled = load_run(str(d.parent))
    assert set(sampled["eval"]) == {"eagle_chain_k5", "eagle_chain_k5@T1"}
    assert sampled["eval"]["eagle_chain_k5@T1"]["all"]["tau"] == 1.6  # the run's own, sampled judgement
    assert sampled["eval"]["eagle_chain_k5"]["all"]["tau"] == 2.1  # its greedy column, beside other greedy runs
    table = markdown([greedy, sampled])
    assert "| tau eagle_chain_k5@T1 [all] | - | 1.60 [1.50, 1.70] |" in table
    row = next(
        line for line in table.splitlines() if line.startswith("| paired tau diff vs greedy: eagle_chain_k5 [all]")
    )
    assert "+0.100 [+0.100, +0.100], 24 better / 0 worse of 24" in row  # greedy vs greedy, paired by prompt


def test_compare_never_silently_replaces_another_comparison(tmp_path: Path) -> None:
    import os
    import subprocess

    a, b, c = (_eval_dir(tmp_path, n, 1.5, 1.4, 1.6) for n in "abc")
    out = tmp_path / "cmp"
    env = {**os.environ, "WANDB_MODE": "disabled"}

    def compare(*args: str) -> subprocess.CompletedProcess[str]:
        return cli.run(["stage=compare", f"hydra.run.dir={out}", *args], env, timeout=300)

    assert compare(f"runs=[{a},{b}]").returncode == 0
    assert compare(f"runs=[{a},{b}]").returncode == 0  # the same comparison again: fine
    refused = compare(f"runs=[{a},{c}]")
    assert refused.returncode == 2 and "overwrite=true" in refused.stderr + refused.stdout
    assert "| | a | b |" in (out / "compare.md").read_text()  # untouched
    assert compare(f"runs=[{a},{c}]", "overwrite=true").returncode == 0
    assert "| | a | c |" in (out / "compare.md").read_text()


def test_a_wandb_run_is_read_through_the_stage_that_wrote_it(tmp_path: Path) -> None:
    run = _eval_dir(tmp_path, "a", 1.50, 1.45, 1.55)
    (run / "eval" / "manifest.json").write_text(json.dumps({"stage": "eval"}))
    offline = run / "eval" / "wandb" / "offline-run-20261201_120000-abc123"
    offline.mkdir(parents=True)
    (offline / "run-abc123.wandb").write_bytes(b":W&B" + bytes(60))  # never decoded
    for entry in (offline, offline / "run-abc123.wandb", run / "eval" / "wandb"):
        got = load_run(str(entry))
        assert got["eval"]["eagle_chain_k5"]["all"]["tau"] == 1.50, entry
        assert got["sources"] == [str(run / "eval" / "metrics.json")]
    assert load_run(str(offline))["label"] == "a"


def _budget_run(root: Path, name: str, tau: float, synth_s: float, features_s: float, train_s: float) -> Path:
    """A run whose stages wrote manifests with their wall times (as stage synth, features and train do)."""
    run = _eval_dir(root, name, tau, tau - 0.05, tau + 0.05)
    for stage, body in (
        ("synth", {"stage": "synth", "counts": {"conversations": 100}, "timings": {"stage_seconds": synth_s}}),
        ("features", {"stage": "features", "tokens": 1000, "timings": {"seconds": features_s}}),
        (
            "train",
            {
                "stage": "train",
                "config": {"train": {"features": "precomputed", "max_steps": 10}, "drafter": {"name": "eagle3"}},
                "result": {"seconds": train_s, "world_size": 2, "steps": 10},
            },
        ),
    ):
        (run / stage).mkdir()
        (run / stage / "manifest.json").write_text(json.dumps(body))
    return run


def test_compare_states_each_runs_machine_time_and_plots_tau_against_it(tmp_path: Path) -> None:
    from train.compare import budget_hours, plot

    small = load_run(str(_budget_run(tmp_path, "small", 1.5, 600.0, 300.0, 900.0)))
    large = load_run(str(_budget_run(tmp_path, "large", 1.9, 1800.0, 900.0, 2700.0)))
    assert small["budget_hours"] == (600 + 300 + 2 * 900) / 3600  # training's two processes count twice
    assert large["budget_hours"] == (1800 + 900 + 2 * 2700) / 3600
    table = markdown([small, large])
    assert "| budget hours (synth + features + train) | 0.75 | 2.25 |" in table
    assert "| synth seconds (stage) | 600 | 1800 |" in table and "| features seconds | 300 | 900 |" in table
    # a drafter trained online did not use the features another run made; without a train manifest: no budget
    online = _budget_run(tmp_path, "online", 1.6, 600.0, 300.0, 900.0)
    manifest = json.loads((online / "train" / "manifest.json").read_text())
    manifest["config"]["train"]["features"] = "online"
    (online / "train" / "manifest.json").write_text(json.dumps(manifest))
    assert load_run(str(online))["budget_hours"] == (600 + 2 * 900) / 3600
    assert budget_hours({"train": {}, "synth": {"seconds": 5.0}}) is None
    plot([small, large], tmp_path / "compare.png")
    assert (tmp_path / "compare.png").stat().st_size > 10_000


def test_compare_shows_context_buckets_and_turns_when_there_are_several(tmp_path: Path) -> None:
    """eval.turns / eval.context_buckets: a bucket or turn is a row of its own (paired by prompt like the rest),
    and only when a source has more than one of them."""
    ids = [f"sharegpt:{i}" for i in range(4)]
    runs = []
    for name, emitted in (("a", 30), ("b", 33)):
        pp = {"ids": ids, "emitted": [emitted] * 4, "steps": [20] * 4}
        d = _eval_dir(tmp_path, name, emitted / 20, 1.4, 1.7, pp) / "eval"
        metrics = json.loads((d / "metrics.json").read_text())
        for m in metrics["metrics"]["eagle_chain_k5"].values():
            short = {"ids": ids[:3], "emitted": [emitted] * 3, "steps": [20] * 3}
            long = {"ids": ids[3:], "emitted": [emitted], "steps": [20]}
            m["by_context"] = {
                "<512": {"tau": emitted / 20, "tau_ci": [1.4, 1.7], "prompts": 3, "per_prompt": short},
                "512-2k": {"tau": emitted / 20, "tau_ci": [emitted / 20] * 2, "prompts": 1, "per_prompt": long},
            }
            m["by_turn"] = {"1": {"tau": emitted / 20, "tau_ci": [1.4, 1.7], "prompts": 4, "per_prompt": pp}}
        (d / "metrics.json").write_text(json.dumps(metrics))
        runs.append(load_run(str(d.parent)))
    assert set(runs[0]["eval"]["eagle_chain_k5"]) == {
        "sharegpt",
        "all",
        "sharegpt ctx <512",
        "sharegpt ctx 512-2k",
        "all ctx <512",
        "all ctx 512-2k",
    }  # one turn: no turn rows
    table = markdown(runs)
    assert "| tau eagle_chain_k5 [all ctx 512-2k] | 1.50 [1.50, 1.50] | 1.65 [1.65, 1.65] |" in table
    row = next(
        line for line in table.splitlines() if line.startswith("| paired tau diff vs a: eagle_chain_k5 [all ctx <512]")
    )
    assert "+0.150 [+0.150, +0.150], 3 better / 0 worse of 3" in row
