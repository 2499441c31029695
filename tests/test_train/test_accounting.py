"""Time, tokens and budget add up across resumes and reruns (the machine-hours a preempted, requeued run really
cost): training resumed from a checkpoint counts the segment before it, each with the torch threads it ran
(``runtime.num_threads``, kept over accelerate's own choice); resuming a finished run keeps its time and
throughput; a synth rerun adds to the stage's seconds instead of replacing them. A tiny target keeps it to seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

from data.tiny_target import make_tiny_target
from tests import cli
from tests.conftest import TINY_SYNTH


def _run(args: list[str], env: dict[str, str]) -> None:
    res = cli.run(args, env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def test_time_and_tokens_accumulate_across_resumes_and_reruns(tmp_path: Path, run_env: dict[str, str]) -> None:
    path = make_tiny_target("llama", tmp_path / "tiny-llama")
    base = [
        *TINY_SYNTH,
        "synth.chunk_size=4",
        "target=hf",
        f"target.path={path}",
        "drafter=eagle3",
        "drafter.draft_vocab_size=512",
    ]
    synth = tmp_path / "synth"
    _run(["stage=synth", *base, f"hydra.run.dir={synth}"], run_env)
    first = json.loads((synth / "manifest.json").read_text())["timings"]
    assert first["stage_segments"] == 1 and first["stage_seconds"] > 0
    _run(["stage=synth", *base, f"hydra.run.dir={synth}"], run_env)  # a rerun of the finished stage
    again = json.loads((synth / "manifest.json").read_text())["timings"]
    assert again["stage_segments"] == 2 and again["stage_seconds"] > first["stage_seconds"]
    assert again["generation_seconds"] == first["generation_seconds"]  # nothing was generated twice

    train = tmp_path / "train"
    args = [*base, "stage=train", f"synth_dir={synth}", "train.features=online", "train.save_every=3"]
    args += ["train.max_steps=6", "train.eval_prompts=1", "train.eval_max_new_tokens=4", f"hydra.run.dir={train}"]
    args.append("runtime.num_threads=3")  # a count no machine's cores / processes gives by chance
    no_omp = {k: v for k, v in run_env.items() if k != "OMP_NUM_THREADS"}  # accelerate then sets its own count
    _run([*args, "train.stop_after_steps=3"], no_omp)  # a job stopped at step 3 (as a preempted one checkpoints)
    part = json.loads((train / "manifest.json").read_text())["result"]
    assert not part["finished"] and [s["steps"] for s in part["segments"]] == [[0, 3]]
    _run([*args, "resume=true"], run_env)
    whole = json.loads((train / "manifest.json").read_text())["result"]
    assert whole["finished"] and [s["steps"] for s in whole["segments"]] == [[0, 3], [3, 6]]
    segs = whole["segments"]
    assert [s["threads"] for s in segs] == [3, 3]  # the threads the user set, recorded per segment
    assert abs(whole["seconds"] - sum(s["seconds"] for s in segs)) < 0.05
    assert segs[0]["seconds"] > 0 and whole["seconds"] > whole["seconds_this_process"]
    assert whole["train_tokens_per_second"] > 0
    _run([*args, "resume=true"], run_env)  # resuming the finished run: no step, time and throughput kept
    kept = json.loads((train / "manifest.json").read_text())["result"]
    assert kept["steps_this_process"] == 0 and kept["seconds"] >= whole["seconds"]
    assert kept["train_tokens_per_second"] > 0 and len(kept["segments"]) == 3

    from train.compare import budget_hours

    run = {"train": {"seconds": kept["seconds"], "segments": kept["segments"], "world_size": 1}}
    assert abs(budget_hours(run) * 3600 - sum(s["seconds"] for s in kept["segments"])) < 0.05

    # the tiny target's head judged against the embedded target: refused from the config files, before it loads
    cmd = ["stage=eval", f"eval.drafter_dir={train / 'best'}", f"synth_dir={synth}"]
    res = cli.run([*cmd, f"hydra.run.dir={tmp_path / 'ev'}"], run_env, timeout=600)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "was made for another target: its hidden size is 128, target smollm2-135m's is 576" in res.stderr
    assert "Target smollm2-135m loaded" not in res.stdout + res.stderr
