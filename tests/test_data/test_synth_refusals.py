"""Synth output of another config is refused naming what changed (as train and eval name the keys), not by two
plan hashes. A tiny target keeps it to seconds."""

from __future__ import annotations

import subprocess
from pathlib import Path

from data.tiny_target import make_tiny_target
from tests import cli


def test_synth_of_another_config_names_the_changed_keys(tmp_path: Path, run_env: dict[str, str]) -> None:
    path = make_tiny_target("llama", tmp_path / "tiny-llama")
    base = ["stage=synth", "experiment=quickstart", "data.max_turns=1", "synth.max_new_tokens=8"]
    base += ["target=hf", f"target.path={path}", f"hydra.run.dir={tmp_path / 'synth'}"]

    def synth(*extra: str) -> subprocess.CompletedProcess[str]:
        return cli.run([*base, *extra], run_env, timeout=600)

    first = synth("data.num_prompts=8")
    assert first.returncode == 0, first.stderr[-3000:]
    other = synth("data.num_prompts=10", "synth.max_new_tokens=9")
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr[-3000:]
    assert "data.num_prompts: 8 -> 10" in other.stderr and "synth.max_new_tokens: 8 -> 9" in other.stderr
    assert "the selected conversations" in other.stderr  # 10 prompts select other conversations too
