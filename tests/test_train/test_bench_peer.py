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
    cmd += ["--out", str(out), "--judge", "peer_judge"]
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    peer = json.loads((out / "peer.json").read_text())
    assert peer["steps_done"] == 3 and peer["budget"]["batch_rows"] == 2
    assert peer["timings"]["tokens_per_s"] > 0 and peer["rows"]["row_tokens"] > 0
    assert peer["verify"]["draftsmith_import"].startswith("ok"), peer["verify"]
    assert peer["loss"]["last"] == peer["loss"]["last"]  # a number, not NaN
    conf = json.loads((out / "config.json").read_text())
    assert conf["speculators_model_type"] == "eagle3" and conf["draft_vocab_size"] == 512
    # --judge: the peer as our own checkpoint, with its norms, layers and vocabulary map
    from train.drafters.registry import load_drafter

    spec, head, dcfg = load_drafter(str(tmp_path / "runs" / "peer_judge" / "train" / "best"), target)
    assert spec.name == "eagle3" and dcfg.draft_vocab_size == 512
    assert head.norms == {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}
    assert dcfg.layer_ids == [2, 15, 27]
