"""The tests' fork server (``tests/cli.py``) gives a child what a real ``python -m train`` gets: the command's
arguments, environment and working directory, stdout and stderr apart, the exit status (code or signal), its own
process group; and falls back to a real process where a fork cannot give the same start (another import-time
environment)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests import cli
from tests.conftest import REPO

TYPO = ["stage=synth", "synth.max_new_tokenz=4"]


def test_a_forked_refusal_equals_the_real_commands() -> None:
    forked = cli.start(TYPO)
    assert isinstance(forked, cli.Forked)
    out, err = forked.communicate(timeout=120)
    real = subprocess.run([sys.executable, "-m", "train", *TYPO], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert forked.returncode == real.returncode == 2
    assert (out, err) == (real.stdout, real.stderr)  # the same lines on the same streams, no warning of our own
    assert err.startswith("error: Unknown config key 'synth.max_new_tokenz'")


def report() -> None:
    """A prelude: what the child was given, written where PROBE_OUT says."""
    with open(os.environ["PROBE_OUT"], "w", encoding="utf-8") as f:
        f.write(
            json.dumps(
                {
                    "env": os.environ.get("PROBE"),
                    "pid": os.getpid(),
                    "pgid": os.getpgid(0),
                    "sid": os.getsid(0),
                    "cwd": os.getcwd(),
                    "argv": sys.argv[1:],
                    "stdin": os.read(0, 10).decode(),
                }
            )
        )


def test_the_child_gets_the_commands_environment_and_a_session_of_its_own(tmp_path) -> None:
    out = tmp_path / "probe.json"
    env = dict(os.environ, PROBE="from-the-command", PROBE_OUT=str(out))
    forked = cli.start(TYPO, env, prelude="tests.test_forkserver:report")
    assert isinstance(forked, cli.Forked)
    forked.communicate(timeout=120)
    got = json.loads(out.read_text())
    assert got == {
        "env": "from-the-command",
        "pid": forked.pid,
        "pgid": forked.pid,
        "sid": forked.pid,
        "cwd": str(REPO),
        "argv": TYPO,
        "stdin": "",
    }
    assert forked.returncode == 2
    assert "PROBE" not in os.environ  # nothing leaks back into the caller


def test_another_import_time_environment_gets_a_real_process() -> None:
    """OpenMP reads OMP_NUM_THREADS when torch loads: a command that sets another value cannot be a fork of the
    zygote (which loaded torch with the suite's), so it runs as a real process, with the same result."""
    threads = "3" if os.environ.get("OMP_NUM_THREADS") != "3" else "2"
    proc = cli.start(TYPO, dict(os.environ, OMP_NUM_THREADS=threads))
    assert isinstance(proc, subprocess.Popen)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and err.startswith("error: Unknown config key 'synth.max_new_tokenz'")


def test_sigkill_and_ctrl_c_end_the_child_as_they_end_a_real_process(tmp_path) -> None:
    """A child killed in its group reports -9; one sent SIGINT raises KeyboardInterrupt inside the stage, which
    ends as the CLI's one-line ``error: interrupted``, exit 130."""
    from data.tiny_target import make_tiny_target
    from tests.conftest import TINY_SYNTH

    path = make_tiny_target("llama", tmp_path / "tiny")
    args = ["stage=synth", *TINY_SYNTH, "data.num_prompts=400", "synth.max_new_tokens=200", "target=hf"]
    args += [f"target.path={path}", "wandb.mode=disabled"]
    for sig, code in ((signal.SIGKILL, -9), (signal.SIGINT, 130)):
        run = tmp_path / f"run-{sig}"
        proc = cli.start([*args, f"hydra.run.dir={run}"])
        assert isinstance(proc, cli.Forked)
        deadline = time.monotonic() + 120
        while proc.poll() is None and not run.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(3)  # the stage is at work (its run directory exists)
        (os.killpg if sig == signal.SIGKILL else os.kill)(proc.pid, sig)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == code, (out, err)
        if sig == signal.SIGINT:
            assert "error: interrupted" in err and "Traceback" not in err, err[-2000:]
