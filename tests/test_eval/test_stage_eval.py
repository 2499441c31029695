"""Stage eval end to end on the real target and real held-out traffic: every method lossless at T=0,
tau/alpha/speedup/c reported per source, our tau == HF assisted generation's for the same draft and K."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import cli
from tests.conftest import REPO, SMALL_SYNTH
from tests.derived import assert_tau_derived

pytestmark = pytest.mark.slow


def _eval(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``python -m train stage=eval <args>`` in the checkout, output captured."""
    return cli.run(["stage=eval", *args], env, timeout=900)


def test_stage_eval_reports_every_method(synth_dir: Path, tmp_path: Path, run_env: dict[str, str], target) -> None:
    from train.drafters import registry

    spec = registry.get("eagle")
    cfg = spec.config_cls(tree_depth=3, tree_top_k=2, tree_total_tokens=6)
    spec.save(spec.build(cfg, target.model), str(tmp_path / "train" / "best"), cfg)  # an untrained head
    out = tmp_path / "eval"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            "stage=eval",
            *SMALL_SYNTH,
            "drafter=eagle",  # the untrained head above is an EAGLE-1 head
            f"synth_dir={synth_dir}",
            f"train_dir={tmp_path / 'train'}",
            f"hydra.run.dir={out}",
            "eval.num_prompts=2",
            "eval.max_new_tokens=16",
            "eval.decode_prompts=1",
            "eval.decode_max_new_tokens=12",
            "eval.k=3",
            "eval.draft_model=target_layers:3",
            "wandb.mode=offline",
            "eval.proposers=[drafter,prompt_lookup,draft_model,hf_assisted,hf_prompt_lookup]",
        ],
        cwd=REPO,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())["metrics"]
    expected = {
        "plain",
        "eagle_chain_k3",
        "eagle_tree_n6",
        "prompt_lookup_k3",
        "draft_model_chain_k3",
        "draft_model_tree_n16",
        "hf_assisted_k3",
        "hf_prompt_lookup_k3",
    }
    assert set(metrics) == expected
    for name, per in metrics.items():
        assert {"sharegpt", "humaneval", "all"} <= set(per), name
        for src, m in per.items():
            assert m["identical_to_plain"] == 1.0, (name, src)  # lossless at temperature 0 (decoded sample)
            assert_tau_derived(m)
            # speed against plain decoding of the same prompts in the same process
            assert m["speedup"] == pytest.approx(m["tokens_per_s"] / metrics["plain"][src]["tokens_per_s"])
            # tau and its interval from replay (2 prompts per source x 16 tokens) for our proposers; HF's peers
            # and plain decoding are decode-only (1 prompt per source x 12 tokens)
            replayed = not name.startswith("hf_") and name != "plain"
            assert m["tau_from"] == ("replay" if replayed else "decode"), name
            assert m["prompts"] == (2 if replayed else 1) * (2 if src == "all" else 1), (name, src)
            assert m["decode_prompts"] == (2 if src == "all" else 1)
    assert all(m["tau"] == 1.0 for m in metrics["plain"].values())
    # Same draft model, same K, greedy: HF assisted generation takes the same drafts and verdicts (decoded).
    ours, hf = metrics["draft_model_chain_k3"]["all"], metrics["hf_assisted_k3"]["all"]
    assert ours["decode_tau"] == pytest.approx(hf["tau"])
    assert metrics["eagle_chain_k3"]["all"]["draft_cost_ratio_c"] > 0
    # the K the built-in decoder would draft here at batch 1, from this eval's alpha, c and v (plain: 0)
    from eval.report import recommend_k

    chain = metrics["eagle_chain_k3"]["all"]
    k, pred = recommend_k(chain["alpha"], chain["verify_cost_ratio_v"], chain["draft_cost_ratio_c"])
    assert (chain["recommended_k"], chain["recommended_predicted_speedup"]) == (k, pytest.approx(pred))
    assert "eagle_tree_n6" not in [n for n, per in metrics.items() if "recommended_k" in per["all"]]
    expected_line = "eagle_chain_k3: on this machine at batch 1 " + (
        f"the built-in decoder would draft K={k}" if k else "no K is predicted to beat plain decoding"
    )
    assert expected_line in (out / "table.md").read_text()
    assert list((synth_dir / "replay").glob("continuations.jsonl"))  # cached beside the held-out split
    table = (out / "table.md").read_text()
    assert "| all | eagle_tree_n6 |" in table and "speedup" in table and "[95% CI]" in table
    assert (out / "acceptance.png").stat().st_size > 5000
    assert list((out / "wandb").glob("offline-run-*"))  # a real offline W&B run was written
    assert "held-out acceptance" in res.stderr + res.stdout


def test_eval_refuses_bad_settings_before_work(synth_dir: Path, tmp_path: Path, run_env: dict[str, str]) -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            "stage=eval",
            f"synth_dir={synth_dir}",
            f"hydra.run.dir={tmp_path}",
            "eval.proposers=[hf_assisted]",
        ],
        cwd=REPO,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode != 0 and "eval.draft_model is not set" in res.stderr


def test_eval_from_data_sources_without_synth(tmp_path: Path, run_env: dict[str, str]) -> None:
    """eval.prompts=data: held-out prompts straight from a prompt source (here the user's own JSONL)."""
    traffic = tmp_path / "traffic.jsonl"
    rows = [{"id": f"r{i}", "prompt": f"Repeat after me: item {i}, item {i}, item {i}."} for i in range(40)]
    traffic.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "eval"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            "stage=eval",
            "data=jsonl",
            f"data.sources.mine.paths=[{traffic}]",
            "data.heldout_fraction=0.2",
            "eval.prompts=data",
            "eval.num_prompts=2",
            "eval.max_new_tokens=8",
            "eval.proposers=[prompt_lookup]",
            f"synth_dir={tmp_path / 'none'}",
            f"hydra.run.dir={out}",
            "wandb.mode=disabled",
        ],
        cwd=REPO,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["num_prompts"] == 2 and set(metrics["metrics"]["prompt_lookup_k5"]) == {"mine", "all"}
    assert metrics["metrics"]["prompt_lookup_k5"]["all"]["identical_to_plain"] == 1.0


def test_any_traffic_file_is_the_judge_in_replay_mode(tmp_path: Path, run_env: dict[str, str]) -> None:
    """eval.prompts=<glob>: every row of the user's traffic files is judged (no held-out split), grouped by its
    source/domain field; bad rows are skipped and counted; replay mode decodes nothing."""
    rows = [
        {"id": f"s{i}", "domain": "sql", "prompt": f"Write a SQL query that counts rows in table t{i}."}
        for i in range(3)
    ]
    rows += [
        {"messages": [{"role": "user", "content": f"Return JSON with key k{i} set to {i}."}], "source": "json"}
        for i in range(2)
    ]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{not json\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"prompt": "Say hello."}) + "\n")
    out = tmp_path / "eval"
    args = [f"eval.prompts={tmp_path}/*.jsonl", "eval.mode=replay", "eval.max_new_tokens=12"]
    args += ["eval.proposers=[prompt_lookup]", f"synth_dir={tmp_path / 'none'}", f"hydra.run.dir={out}"]
    res = _eval([*args, "wandb.mode=disabled"], run_env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    per = metrics["metrics"]["prompt_lookup_k5"]
    assert set(per) == {"sql", "json", "b", "all"} and "plain" not in metrics["metrics"]  # nothing decoded
    assert [per[s]["prompts"] for s in ("sql", "json", "b", "all")] == [3, 2, 1, 6]
    assert per["all"]["tau_from"] == "replay"
    assert_tau_derived(per["all"])
    assert (out / "replay" / "continuations.jsonl").is_file()
    assert "bad_json" in res.stderr + res.stdout  # the broken row is skipped and counted


def test_sampling_replays_sampled_paths_at_every_temperature(tmp_path: Path, run_env: dict[str, str]) -> None:
    """eval.temperature>0: tau from sampled replay (eval.samples paths per prompt) beside the sampling decoder's own
    tau and the expected tau along its sampled paths; eval.temperatures adds one column per temperature (table,
    metrics, by_temperature); bad temperature lists are refused before any work."""
    (tmp_path / "t.jsonl").write_text(
        "\n".join(json.dumps({"prompt": f"Count from {i} to {i + 9}, comma separated."}) for i in range(2)) + "\n"
    )
    common = [
        f"eval.prompts={tmp_path / 't.jsonl'}",
        "eval.temperature=0.8",
        "eval.max_new_tokens=16",
        "eval.k=3",
        "eval.decode=chain",
        "eval.proposers=[draft_model]",
        "eval.draft_model=target_layers:6",
        f"synth_dir={tmp_path / 'none'}",
        "wandb.mode=disabled",
    ]
    for bad, says in (
        (["eval.temperatures=[0,-1]"], "eval.temperatures"),
        (["eval.mode=decode", "eval.temperatures=[0,1]"], "eval.mode=replay or both"),
    ):
        refused = _eval([*common, *bad, f"hydra.run.dir={tmp_path / 'refused'}"], run_env)
        assert refused.returncode == 2 and says in refused.stderr + refused.stdout, bad
        assert not (tmp_path / "refused" / "metrics.json").exists()
    out = tmp_path / "eval"
    res = _eval([*common, "eval.samples=2", "eval.temperatures=[0,0.8]", f"hydra.run.dir={out}"], run_env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    m = json.loads((out / "metrics.json").read_text())["metrics"]["draft_model_chain_k3"]["all"]
    assert m["tau_from"] == "replay" and m["prompts"] == 2 and 2 * 16 < m["new_tokens_judged"] <= 2 * 2 * 16
    assert 1.0 <= m["expected_tau"] <= 4.0 and len(m["expected_alpha"]) == 3 and m["decode_tau"] >= 1.0
    assert set(m["by_temperature"]) == {"0", "0.8"} and m["by_temperature"]["0.8"]["tau"] == m["tau"]
    assert m["by_temperature"]["0"]["new_tokens_judged"] <= 2 * 16  # greedy: one path per prompt (to its eos)
    table = (out / "table.md").read_text()
    assert "Sampled at temperature 0.8" in table and "| T=0 | T=0.8 |" in table and "(expected " in table
    conts = (out / "replay" / "continuations.jsonl").read_text().splitlines()
    assert len(conts) == 2 + 2 * 2  # greedy + two sampled paths per prompt, each cached under its own key
