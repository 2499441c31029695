"""Nothing lost, nothing mixed, no tracebacks for user errors (issue 12): run locks with real processes, honest
resume (changed config, corrupt and planted checkpoint files), an empty held-out split, eval's refusal to
replace another config's output, and user errors that exit 2 with a one-line message."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import cli
from tests.conftest import REPO, SMALL_SYNTH, compose
from tests.test_train.runs import run_train

TRAIN = [
    "stage=train",
    *SMALL_SYNTH,
    "drafter=eagle",
    "train.features=online",
    "train.micro_batch_size=2",
    "train.lr=1e-3",
    "train.warmup_steps=1",
    "train.save_every=2",
    "train.eval_every=0",
    "train.eval_prompts=1",
    "train.eval_max_new_tokens=6",
    "train.log_every=1",
    "deepspeed=none",
    "wandb.mode=disabled",
]


def _run(args: list[str], env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return cli.run(args, env, timeout=timeout)


def _user_error(res: subprocess.CompletedProcess[str], *needles: str) -> None:
    out = res.stdout + res.stderr
    assert res.returncode == 2, out[-3000:]
    assert "error: " in res.stderr and "Traceback" not in out, out[-3000:]
    for n in needles:
        assert n in out, (n, out[-3000:])


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not path.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert path.exists(), f"{path} never appeared (process exit {proc.poll()})"


# -- 2. one writer per run directory ------------------------------------------------------------------------------


@pytest.mark.slow
def test_second_writer_is_refused_and_a_killed_runs_lock_is_taken_over(
    synth_dir: Path, tmp_path: Path, run_env: dict[str, str]
) -> None:
    run = tmp_path / "train"
    base = [*TRAIN, f"synth_dir={synth_dir}", f"hydra.run.dir={run}"]
    first = run_train([*base, "train.max_steps=100000"], run_env)
    try:
        _wait_for(run / "checkpoints" / "step-000002" / "trainer_state.json", first)
        holder = json.loads((run / ".lock").read_text())
        assert holder["pid"] == first.pid and holder["host"] == socket.gethostname()
        # overwrite=true while the first run is still training: refused, naming the holder, nothing touched
        second = _run([*base, "train.max_steps=2", "overwrite=true"], run_env)
        _user_error(second, f"pid {first.pid}", f"host {socket.gethostname()}", "is in use by")
        assert first.poll() is None and list((run / "checkpoints").glob("step-*"))
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert (run / ".lock").exists()  # SIGKILL: the lock stays behind, and is detected as stale
    third = _run([*base, "train.max_steps=2", "overwrite=true"], run_env)
    assert third.returncode == 0, (third.stdout + third.stderr)[-3000:]
    assert "stale lock" in third.stdout + third.stderr
    assert not (run / ".lock").exists()  # released at the end of the stage
    assert json.loads((run / "manifest.json").read_text())["result"]["steps"] == 2


def test_synth_refused_while_another_process_holds_the_directory(tmp_path: Path, run_env: dict[str, str]) -> None:
    """A second synth (e.g. overwrite=true, or the same command twice) into a directory another live process
    writes is refused before it loads the target; so is a shard task while an unsharded synth runs."""
    out = tmp_path / "synth"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from train.runlock import RunLock; RunLock(sys.argv[1], 'synth').acquire(); "
            "print('locked', flush=True); time.sleep(120)",
            str(out),
        ],
        cwd=REPO,
        env=run_env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        t0 = time.perf_counter()
        res = _run(["stage=synth", *SMALL_SYNTH, f"hydra.run.dir={out}", "overwrite=true"], run_env)
        _user_error(res, f"pid {holder.pid}", "is in use by")
        shard = _run(
            ["stage=synth", *SMALL_SYNTH, f"hydra.run.dir={out}", "synth.num_shards=2", "synth.shard_index=1"], run_env
        )
        _user_error(shard, f"pid {holder.pid}")
        assert time.perf_counter() - t0 < 60  # refused at start-up, not after loading the target
        assert not (out / "data").exists()
    finally:
        holder.kill()
        holder.wait()


def test_lock_unit_behaviour(tmp_path: Path) -> None:
    from train.runlock import RunLock, RunLockedError

    a = RunLock(tmp_path, "synth")
    a.acquire()
    with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):
        RunLock(tmp_path, "synth").acquire()
    a.release()
    assert not (tmp_path / ".lock").exists()
    # a dead process's lock on this host is stale; another host's lock is never judged stale here
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    (tmp_path / ".lock").write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "time": 0}))
    with RunLock(tmp_path, "synth"):
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    (tmp_path / ".lock").write_text(json.dumps({"pid": pid, "host": "some-other-node", "time": 0}))
    with pytest.raises(RunLockedError, match="some-other-node"):
        RunLock(tmp_path, "synth").acquire()


def test_a_lock_that_was_never_written_cannot_block_a_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection at the lock: the disk fills (or the process dies) between creating the lock file and writing
    its holder. A failed write removes the file and says why; an empty or unreadable lock left by a killed process
    is stale once it is older than the grace period (younger, it may still be being written: refused)."""
    import errno

    from data.config import ConfigError
    from train import runlock
    from train.runlock import RunLock, RunLockedError

    real_fsync = os.fsync

    def full_disk(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(runlock.os, "fsync", full_disk)
    with pytest.raises(ConfigError, match="No space left on device; free disk space"):
        RunLock(tmp_path, "train").acquire()
    assert not (tmp_path / ".lock").exists()  # nothing left to block the next run
    monkeypatch.setattr(runlock.os, "fsync", real_fsync)
    with RunLock(tmp_path, "train"):
        pass

    for content in ("", "{not json"):  # killed between create and write / mid-write
        lock = tmp_path / ".lock"
        lock.write_text(content)
        with pytest.raises(RunLockedError):  # just created: maybe still being written
            RunLock(tmp_path, "train").acquire()
        old = time.time() - runlock.EMPTY_LOCK_GRACE_S - 5
        os.utime(lock, (old, old))
        with RunLock(tmp_path, "train"):
            assert json.loads(lock.read_text())["pid"] == os.getpid()
        assert not lock.exists()


# -- 3, 6, 7. honest resume --------------------------------------------------------------------------------------


class _Planted:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
def test_resume_checks_config_refuses_planted_pickles_and_skips_corrupt_checkpoints(
    synth_dir: Path, tmp_path: Path, run_env: dict[str, str]
) -> None:
    run = tmp_path / "train"
    base = [*TRAIN, f"synth_dir={synth_dir}", f"hydra.run.dir={run}"]
    res = _run([*base, "train.max_steps=4"], run_env)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    ckpts = run / "checkpoints"
    assert (ckpts / "step-000002").is_dir() and (ckpts / "step-000004").is_dir()

    # 3. a changed learning rate is not silently ignored: refused, naming the key, before the target loads
    res = _run([*base, "train.max_steps=6", "resume=true", "train.lr=5e-2"], run_env)
    _user_error(res, "train.lr", "0.001 -> 0.05")
    assert "Target smollm2-135m loaded" not in res.stdout + res.stderr

    # 4. checkpoints written before a config key existed (here train.ema_warmup, stripped from their saved config):
    # resumable at the key's schema default (the old code's behaviour; steps 7 below), refused at any other value
    for state_file in ckpts.glob("step-*/trainer_state.json"):
        state = json.loads(state_file.read_text())
        del state["config"]["train"]["ema_warmup"]
        state_file.write_text(json.dumps(state))
    res = _run([*base, "train.max_steps=6", "resume=true", "train.ema_warmup=2"], run_env)
    _user_error(res, "train.ema_warmup", "'<unset>' -> 2.0")

    # 6. a planted pickle in the checkpoint would run code under accelerate's weights_only=False: refused
    marker = tmp_path / "pwned"
    pkl = ckpts / "step-000004" / "state" / "custom_checkpoint_0.pkl"
    original = pkl.read_bytes()
    pkl.write_bytes(pickle.dumps(_Planted(str(marker))))
    res = _run([*base, "train.max_steps=6", "resume=true"], run_env)
    _user_error(res, "refusing to load", "custom_checkpoint_0.pkl")
    assert not marker.exists()
    pkl.write_bytes(original)

    # 7. a truncated optimizer state in the newest checkpoint: the older one is resumed, saying which and why
    opt = ckpts / "step-000004" / "state" / "optimizer.bin"
    opt.write_bytes(opt.read_bytes()[: opt.stat().st_size // 2])
    shutil.copytree(ckpts / "step-000004", ckpts / ".step-000006.tmp")  # a save that was killed half-way
    res = _run([*base, "train.max_steps=5", "resume=true", "train.save_every=1"], run_env)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "skipping checkpoint step-000004" in out and "optimizer.bin" in out and "truncated" in out
    assert "resumed from the older checkpoint step-000002" in out
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["result"]["steps"] == 5
    (resume,) = manifest["resumes"]
    assert resume["from"] == "step-000002" and resume["skipped"][0]["checkpoint"] == "step-000004"
    assert resume["changed"] == {"train.max_steps": [4, 5], "train.save_every": [2, 1]}  # safe keys, recorded
    assert (ckpts / "step-000005").is_dir() and (run / "best" / "model.safetensors").is_file()
    assert (ckpts / ".step-000004.corrupt" / "state" / "optimizer.bin").is_file()  # set aside, not resumed again
    assert not (ckpts / ".step-000006.tmp").exists() and "a write of" in out and ".step-000006.tmp" in out


def test_resume_treats_a_newer_key_at_its_default_as_unchanged(tmp_path: Path) -> None:
    """A key the checkpoint's saved config lacks (the code gained it later) is unchanged at its schema default and a
    refused change at any other value; a key the saved config has is compared as before."""
    from data.config import ConfigError
    from train.checkpoints import compare_resume_config

    saved = {"train": {"lr": 1e-3, "max_steps": 4}}
    defaults = {"train": {"lr": 1e-3, "max_steps": 100, "ema_warmup": 10.0}}
    requested = {"train": {"lr": 1e-3, "max_steps": 6, "ema_warmup": 10.0}}
    assert compare_resume_config(saved, requested, tmp_path, defaults) == {"train.max_steps": [4, 6]}
    with pytest.raises(ConfigError, match=re.escape("train.ema_warmup: '<unset>' -> 10.0")):
        compare_resume_config(saved, requested, tmp_path)  # no defaults given: every new key is a change
    with pytest.raises(ConfigError, match=re.escape("train.ema_warmup: '<unset>' -> 2.0")):
        compare_resume_config(saved, {"train": {**requested["train"], "ema_warmup": 2.0}}, tmp_path, defaults)
    with pytest.raises(ConfigError, match=re.escape("train.lr: 0.001 -> 0.002")):
        compare_resume_config(saved, {"train": {**requested["train"], "lr": 2e-3}}, tmp_path, defaults)


# -- 1. an empty held-out split ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_empty_heldout_split_trains_without_checks_and_leaves_best_and_manifest(
    synth_dir: Path, tmp_path: Path, run_env: dict[str, str]
) -> None:
    synth = tmp_path / "synth"
    shutil.copytree(synth_dir, synth, ignore=shutil.ignore_patterns(".lock", "replay"))
    (synth / "heldout.jsonl").write_text("")  # as synth writes it when the split is empty: counted 0
    manifest = json.loads((synth / "manifest.json").read_text())
    manifest["counts"]["heldout"] = 0
    (synth / "manifest.json").write_text(json.dumps(manifest))
    run = tmp_path / "train"
    res = _run(
        [*TRAIN, f"synth_dir={synth}", f"hydra.run.dir={run}", "train.max_steps=2", "train.eval_every=1"], run_env
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "held-out checks skipped" in out
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["result"]["finished"] and manifest["result"]["heldout_checks"].startswith("skipped")
    assert manifest["result"]["best"]["tau"] is None
    assert (run / "best" / "model.safetensors").is_file() and (run / "checkpoints" / "step-000002").is_dir()
    assert not list((run / "checkpoints").glob(".*.tmp"))


def test_empty_heldout_split_is_reported_at_selection(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from data.sources import SkipCounter
    from data.split import select

    traffic = tmp_path / "t.jsonl"
    traffic.write_text("".join(json.dumps({"id": i, "prompt": f"question {i}"}) + "\n" for i in range(5)))
    cfg = compose(["data=jsonl", f"data.sources.mine.paths=[{traffic}]", "data.heldout_fraction=0.0"])
    with caplog.at_level("WARNING"):
        sel = select(cfg.data, SkipCounter())
    assert len(sel.train) == 5 and not sel.heldout
    assert "held-out split is empty: 5 valid conversations read (mine: 5)" in caplog.text


# -- 4. every stage refuses to replace another config's output -----------------------------------------------------


def test_eval_refuses_to_replace_results_of_another_config(tmp_path: Path, run_env: dict[str, str]) -> None:
    from data.config import ConfigError
    from data.manifest import check_same_config, write_manifest

    out = tmp_path / "eval"
    args = ["stage=eval", *SMALL_SYNTH, f"synth_dir={tmp_path / 'synth'}", f"train_dir={tmp_path / 'train'}"]
    write_manifest(out / "manifest.json", "eval", compose([*args, "eval.max_new_tokens=16"]))
    (out / "metrics.json").write_text("{}")
    res = _run([*args, f"hydra.run.dir={out}", "eval.max_new_tokens=32"], run_env)
    _user_error(res, "eval.max_new_tokens: 16 -> 32", "overwrite=true")
    assert (out / "metrics.json").read_text() == "{}"
    check_same_config(out, "eval", compose([*args, "eval.max_new_tokens=16", "wandb.mode=disabled"]))  # same: fine
    check_same_config(out, "eval", compose([*args, "eval.max_new_tokens=32", "overwrite=true"]))  # told to: fine
    with pytest.raises(ConfigError, match=r"eval\.k"):
        check_same_config(out, "eval", compose([*args, "eval.max_new_tokens=16", "eval.k=2"]))
    with pytest.raises(ConfigError, match=r"eval\.mode: 'both' -> 'decode'"):  # choices as typed, not enum reprs
        check_same_config(out, "eval", compose([*args, "eval.max_new_tokens=16", "eval.mode=decode"]))


# -- 8, 9. user errors: exit 2, one line, before the target loads ---------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["stage=synth", "target=hf"], "target.path must be set"),
        (["stage=synth", "run_name=../../x"], "run_name='../../x' is not a safe name"),
        (["stage=train", "synth_dir=/nonexistent/synth"], "/nonexistent/synth/manifest.json not found"),
        (
            ["stage=train", "train.features=precomputed", "train.features_dir=/nonexistent/f"],
            "/nonexistent/f holds no finished features",
        ),
        (
            ["stage=eval", "eval.prompts=/nonexistent/t.jsonl", "eval.proposers=[prompt_lookup]"],
            "eval.prompts: /nonexistent/t.jsonl does not exist",
        ),
        (["stage=synth", "data=jsonl", "data.sources.mine.paths=[/tmp]"], "/tmp is a directory, not a file"),
        # Hydra's own composition errors, ended as ours
        (["stage=synth", "train.lr=abc"], "train.lr=abc: Value 'abc' of type 'str' could not be converted to Float"),
        (["stage=synth", "drafter=foo"], "Could not find 'drafter/foo': Available options in 'drafter': dflash, eagle"),
        # a training setting that could never finish is refused before stage all's synth runs
        (["stage=all", "train.eval_prompts=0"], "train.eval_prompts=0 must be >= 1"),
    ],
)
def test_user_errors_exit_2_without_traceback(
    tmp_path: Path, run_env: dict[str, str], args: list[str], needle: str
) -> None:
    res = _run([*args, f"hydra.run.dir={tmp_path / 'out'}", "wandb.mode=disabled"], run_env, timeout=120)
    _user_error(res, needle)
    assert not (tmp_path / "out").exists()  # a command that wrote nothing leaves no empty run directory behind


def test_debug_flag_shows_the_traceback(tmp_path: Path, run_env: dict[str, str]) -> None:
    res = _run(["--debug", "stage=synth", "target=hf", f"hydra.run.dir={tmp_path}"], run_env, timeout=120)
    assert res.returncode != 0 and "Traceback" in res.stderr and "target.path must be set" in res.stderr


def test_schema_entries_are_not_drafter_choices(run_env: dict[str, str], tmp_path: Path) -> None:
    res = _run(["stage=train", "drafter=eagle_schema", f"hydra.run.dir={tmp_path}"], run_env, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 2 and "error: " in res.stderr and "Could not find 'drafter/eagle_schema'" in out
    options = out.split("Available options in 'drafter':", 1)[1].split("(in the command-line", 1)[0]
    from train.drafters import registry

    presets = sorted(p.stem for p in (REPO / "conf" / "drafter").glob("*.yaml"))
    offered = [o.strip() for o in options.split(",")]
    # the families and the presets (conf/drafter/*.yaml), sorted; no schema entries
    assert offered == presets and set(registry.names()) <= set(offered)
    assert not any("schema" in o for o in offered)


# -- 7. corrupt or missing inputs are named, with a hint, before the target loads ---------------------------------


def test_corrupt_or_missing_inputs_are_named(tmp_path: Path, run_env: dict[str, str]) -> None:
    import torch
    from safetensors.torch import save_file

    synth = tmp_path / "synth"
    synth.mkdir()
    (synth / "manifest.json").write_text('{"stage": "synth", "conf')  # truncated JSON
    res = _run(["stage=train", f"synth_dir={synth}", f"hydra.run.dir={tmp_path / 'train'}"], run_env, timeout=120)
    _user_error(res, f"{synth / 'manifest.json'} is corrupt (not valid JSON")

    ev = ["stage=eval", f"synth_dir={synth}", f"hydra.run.dir={tmp_path / 'eval'}", "wandb.mode=disabled"]
    res = _run([*ev, f"train_dir={tmp_path / 'nowhere'}"], run_env, timeout=120)
    _user_error(res, f"no drafter in {tmp_path / 'nowhere' / 'best'} (directory missing)", "eval.drafter_dir")

    best = tmp_path / "train" / "best"
    best.mkdir(parents=True)
    (best / "config.json").write_text(json.dumps({"draftsmith": {"drafter": {"name": "eagle"}}}))
    save_file({"w": torch.zeros(64, 64)}, str(best / "model.safetensors"))
    data = (best / "model.safetensors").read_bytes()
    (best / "model.safetensors").write_bytes(data[: len(data) // 2])
    res = _run([*ev, f"train_dir={tmp_path / 'train'}"], run_env, timeout=120)
    _user_error(res, f"{best / 'model.safetensors'}: truncated or corrupt", "Hint:")
    assert "Target smollm2-135m loaded" not in res.stdout + res.stderr


@pytest.mark.slow
def test_features_of_other_inputs_are_refused_not_mixed(
    synth_dir: Path, tmp_path: Path, run_env: dict[str, str]
) -> None:
    feats = tmp_path / "features"
    base = ["stage=features", *SMALL_SYNTH, f"synth_dir={synth_dir}", f"hydra.run.dir={feats}", "wandb.mode=disabled"]
    res = _run([*base, "drafter=eagle"], run_env)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    parts = {p.name: p.stat().st_mtime_ns for p in feats.glob("part-*.safetensors")}
    assert parts and json.loads((feats / "plan.json").read_text())["layers"] == [30]
    res = _run([*base, "drafter=eagle3"], run_env)  # other layers into the same directory: refused
    _user_error(res, "holds features made from other inputs (differs in: layers)", "overwrite=true")
    assert {p.name: p.stat().st_mtime_ns for p in feats.glob("part-*.safetensors")} == parts


def test_truncated_or_empty_heldout_split_is_named_at_eval(tmp_path: Path, run_env: dict[str, str]) -> None:
    synth = tmp_path / "synth"
    synth.mkdir()
    row = {"id": "a", "source": "mine", "messages": [{"role": "user", "content": "hi"}]}
    (synth / "heldout.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(row)[:20])  # cut mid-row
    ev = ["stage=eval", f"synth_dir={synth}", f"hydra.run.dir={tmp_path / 'eval'}", "eval.proposers=[prompt_lookup]"]
    res = _run([*ev, "wandb.mode=disabled"], run_env, timeout=120)
    _user_error(res, f"{synth / 'heldout.jsonl'}:2: corrupt held-out row", "Hint:")
    (synth / "heldout.jsonl").write_text("")
    res = _run([*ev, "wandb.mode=disabled"], run_env, timeout=120)
    _user_error(res, f"{synth / 'heldout.jsonl'} is empty", "data.heldout_fraction")


def test_state_file_gate_accepts_deepspeed_data_and_refuses_code(tmp_path: Path) -> None:
    """DeepSpeed's checkpoint files (ZeRO stage enum, loss scaler objects, a copied zero_to_fp32.py) pass the
    weights_only gate; a reduce to os.system does not, and nothing runs."""
    import torch
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from train.checkpoints import UnsafeCheckpointError, check_state_file, verify_checkpoint

    ckpt = tmp_path / "step-000001"
    (ckpt / "state" / "pytorch_model").mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1}))
    optim = {
        "zero_stage": ZeroStageEnum.gradients,
        "loss_scaler": DynamicLossScaler(2.0**16, 1000, 1.0, 2, False),
        "w": torch.ones(2),
    }
    torch.save(optim, ckpt / "state" / "pytorch_model" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (ckpt / "state" / "pytorch_model" / "zero_to_fp32.py").write_text("print('not a pickle')\n")
    (ckpt / "state" / "latest").write_text("pytorch_model")
    assert verify_checkpoint(ckpt)["step"] == 1
    marker = tmp_path / "pwned"
    bad = ckpt / "state" / "random_states_0.pkl"
    torch.save({"rng": _Planted(str(marker))}, bad)
    with pytest.raises(UnsafeCheckpointError, match=r"random_states_0\.pkl") as refused:
        check_state_file(bad)
    assert not marker.exists()
    # the message names the offending global and never relays torch's advice to retry with weights_only=False
    assert "posix.system" in str(refused.value) or "os.system" in str(refused.value), str(refused.value)
    assert "set to `False`" not in str(refused.value) and "do not load it with weights_only=False" in str(refused.value)
