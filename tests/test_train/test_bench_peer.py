"""scripts/bench_peer.py end to end at a tiny budget: speculators' own EAGLE-3 trainer (in the engine venv, with the
script's CPU patches) trains on our synth rows in our batch order, its checkpoint loads in speculators and in our
importer, and --judge saves it as one of our checkpoints that stage=eval can judge."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.test_export.test_vllm_parity import needs_engine

pytestmark = pytest.mark.slow


@needs_engine
def test_peer_trains_loads_and_is_judged_as_ours(synth_dir: Path, tmp_path: Path, target) -> None:
    out = tmp_path / "peer"
    cmd = [sys.executable, str(REPO / "scripts" / "bench_peer.py"), "--synth-dir", str(synth_dir)]
    cmd += ["--steps", "3", "--batch-rows", "2", "--warmup", "1", "--draft-vocab", "512", "--optimizer", "adamw"]
    # speculators' own precision (a bf16 autocast, what the 1-hour comparison gives it); float32 is a no-op autocast
    cmd += ["--precision", "bfloat16", "--out", str(out), "--judge", "peer_judge"]
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    peer = json.loads((out / "peer.json").read_text())
    assert peer["steps_done"] == 3 and peer["budget"]["batch_rows"] == 2
    assert peer["timings"]["tokens_per_s"] > 0 and peer["rows"]["row_tokens"] > 0
    assert peer["verify"]["draftsmith_import"].startswith("ok"), peer["verify"]
    assert peer["loss"]["last"] == peer["loss"]["last"]  # a number, not NaN
    assert peer["budget"]["precision"] == "bfloat16"
    assert peer["speculators_config"]["data"]["hidden_states_dtype"] == "bfloat16"
    conf = json.loads((out / "config.json").read_text())
    assert conf["speculators_model_type"] == "eagle3" and conf["draft_vocab_size"] == 512
    # --judge: the peer as our own checkpoint, with its norms, layers and vocabulary map
    from train.drafters.registry import load_drafter

    spec, head, dcfg = load_drafter(str(tmp_path / "runs" / "peer_judge" / "train" / "best"), target)
    assert spec.name == "eagle3" and dcfg.draft_vocab_size == 512
    assert head.norms == {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}
    assert dcfg.layer_ids == [2, 15, 27]


def test_vs_peer_budget_and_vllm_statistics() -> None:
    """scripts/bench_vs_peer.py: the peer gets exactly our run's budget, and vLLM's per-prompt counters become tau,
    the ratio, the paired difference (ours minus the peer) and per-position shares without mixing up the sides."""
    from scripts.bench_vs_peer import compare_vllm, peer_budget

    manifest = {
        "config": {
            "seed": 3,
            "train": {"max_steps": 150, "micro_batch_size": 8, "lr": 0.001, "warmup_steps": 10, "grad_accum": 1,
                      "bucket_size": 64, "max_seq_len": 768},
            "drafter": {"ttt_steps": 3, "draft_vocab_size": 8192},
        },
        "result": {"world_size": 1},
    }  # fmt: skip
    argv = peer_budget(manifest, [2, 15, 27])
    got = dict(zip(argv[::2], argv[1::2], strict=True))
    assert got == {"--steps": "150", "--batch-rows": "8", "--lr": "0.001", "--warmup": "10", "--ttt-steps": "3",
                   "--draft-vocab": "8192", "--layers": "2,15,27", "--seed": "3", "--bucket-size": "64",
                   "--max-seq-len": "768", "--precision": "float32"}  # fmt: skip
    # a bf16 autocast of ours (asked for, or auto on a GPU: the manifest's resolved precision) -> the peer's own bf16
    for train, result in (({"dtype": "bfloat16"}, {}), ({"dtype": "auto"}, {"precision": "bf16"})):
        bf16 = {"config": {**manifest["config"], "train": {**manifest["config"]["train"], **train}},
                "result": {**manifest["result"], **result}}  # fmt: skip
        assert peer_budget(bf16, [2, 15, 27])[-2:] == ["--precision", "bfloat16"]
    manifest["config"]["train"]["grad_accum"] = 2
    with pytest.raises(SystemExit, match="gradient accumulation"):
        peer_budget(manifest, [2, 15, 27])

    def row(src: str, i: int, drafts: int, accepted: int, per_pos: list[int], tokens: list[int]) -> dict:
        return {"source": src, "id": str(i), "drafts": drafts, "accepted": accepted, "per_pos": per_pos,
                "tokens": tokens}  # fmt: skip

    ours = [row("a", 0, 10, 6, [4, 2, 0], [1, 2]), row("a", 1, 10, 4, [3, 1, 0], [3])]
    ours.append(row("b", 2, 20, 10, [8, 2, 0], [4]))
    peer = [row("a", 0, 10, 5, [4, 1, 0], [1, 2]), row("a", 1, 10, 2, [2, 0, 0], [3])]
    peer.append(row("b", 2, 20, 10, [8, 2, 0], [5]))
    r = compare_vllm(ours, peer, k=3)
    assert r["all"]["tau_ours"] == 1.5 and r["all"]["tau_peer"] == 1.425  # 1 + 20/40, 1 + 17/40
    assert r["all"]["ratio"] == round(1.5 / 1.425, 4)
    assert r["all"]["paired"]["diff"] == pytest.approx(0.075) and r["all"]["paired"]["better"] == 2
    assert r["all"]["paired"]["worse"] == 0 and r["all"]["paired"]["prompts"] == 3
    assert r["a"]["tau_ours"] == 1.5 and r["a"]["tau_peer"] == 1.35 and r["b"]["ratio"] == 1.0
    assert r["all"]["position_shares_ours"] == [0.375, 0.125, 0.0]
    assert r["all"]["outputs_identical"] == 2 and r["a"]["outputs_identical"] == 2
    with pytest.raises(SystemExit, match="same prompts"):
        compare_vllm(ours, peer[::-1], k=3)


def test_vs_peer_reuses_a_peer_only_for_the_same_plan_and_budget(tmp_path: Path) -> None:
    """--peer-from: an earlier comparison's peer is reused only if its peer.json names the same synth plan and exactly
    the budget our run asks for, with no other bench_peer.py option; the peer's vLLM rows only for the same prompts,
    K and token count."""
    import argparse

    from scripts.bench_vs_peer import check_peer_reusable, same_serving

    budget = ["--steps", "150", "--batch-rows", "8", "--lr", "0.001", "--seed", "2"]
    cmd = ["/usr/bin/python", "/x/scripts/bench_peer.py", "--synth-dir", "runs/s/synth", "--out", "runs/peer/a",
           "--overwrite", "--judge", "a_peer", *budget]  # fmt: skip
    peer = {"command": cmd, "synth_plan": "abc"}
    check_peer_reusable(peer, budget, "abc")  # the same: no error
    with pytest.raises(SystemExit, match="another budget"):
        check_peer_reusable(peer, [*budget[:-1], "3"], "abc")  # another seed
    with pytest.raises(SystemExit, match="another synth plan"):
        check_peer_reusable(peer, budget, "abd")
    with pytest.raises(SystemExit, match="extra option '--optimizer'"):
        check_peer_reusable({**peer, "command": [*cmd[: -len(budget)], "--optimizer", "adamw", *budget]}, budget, "abc")
    with pytest.raises(SystemExit, match=r"no bench_peer\.py command"):
        check_peer_reusable({"synth_plan": "abc"}, budget, "abc")

    earlier = tmp_path / "a"
    (earlier / "serve").mkdir(parents=True)
    (earlier / "serve" / "prompts.json").write_text('[{"id": "1", "input_ids": [1, 2]}]')
    (earlier / "serve" / "vllm_peer_k3.json").write_text("{}")
    (earlier / "summary.json").write_text(json.dumps({"vllm": {"k": 3, "max_new_tokens": 64}}))
    ours = tmp_path / "prompts.json"
    ours.write_text('[{"id": "1", "input_ids": [1, 2]}]')
    args = argparse.Namespace(k=3, max_new_tokens=64)
    assert same_serving(earlier, ours, args)
    assert not same_serving(earlier, ours, argparse.Namespace(k=3, max_new_tokens=128))
    assert not same_serving(earlier, ours, argparse.Namespace(k=2, max_new_tokens=64))
    ours.write_text('[{"id": "1", "input_ids": [1, 3]}]')
    assert not same_serving(earlier, ours, args)
    assert not same_serving(tmp_path / "none", ours, args)
