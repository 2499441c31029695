"""The vLLM worker of stage synth never outlives the stage (data/vllm_engine.stop_group_with_parent).

Checked with the real watchdog on a real process tree shaped like the engine's: the stage (here a "stage" process
we kill), the worker leading its own process group (as ``VLLMEngine`` starts it), and a child of the worker in
that group (as vLLM's EngineCore is). The engine itself is not needed to test the mechanism; it is not started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO

WORKER = """
import subprocess, sys, time
from data.vllm_engine import stop_group_with_parent
stop_group_with_parent(0.1)
child = subprocess.Popen(["sleep", "600"])  # stands for vLLM's EngineCore: same process group
print(child.pid, flush=True)
time.sleep(600)
"""

STAGE = """
import os, subprocess, sys, time
w = subprocess.Popen([sys.executable, "-c", {worker!r}], stdout=subprocess.PIPE, text=True, start_new_session=True)
print(w.pid, w.stdout.readline().strip(), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"  # a zombie has stopped running (nobody may reap it inside a container)


def _wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _start_stage() -> tuple[subprocess.Popen[str], int, int]:
    stage = subprocess.Popen(
        [sys.executable, "-c", STAGE.format(worker=WORKER)], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    assert stage.stdout is not None
    worker_pid, child_pid = (int(x) for x in stage.stdout.readline().split())
    assert _alive(worker_pid) and _alive(child_pid)
    assert os.getpgid(child_pid) == worker_pid  # the engine's processes are in the worker's group
    return stage, worker_pid, child_pid


def test_the_engine_group_stops_when_the_stage_is_killed() -> None:
    stage, worker_pid, child_pid = _start_stage()
    stage.kill()  # SIGKILL: the stage runs no cleanup at all
    stage.wait()
    assert _wait_gone([worker_pid, child_pid]) == []


def test_the_engine_group_stops_on_sigterm_to_the_worker() -> None:
    stage, worker_pid, child_pid = _start_stage()
    try:
        os.kill(worker_pid, signal.SIGTERM)
        assert _wait_gone([worker_pid, child_pid]) == []
        assert stage.poll() is None  # the stage itself is not in the engine's group
    finally:
        stage.kill()
        stage.wait()


def test_close_after_an_error_stops_the_engine_group_at_once() -> None:
    """What stage synth does on an exception or Ctrl-C: the worker (in its own session, so the terminal's Ctrl-C does
    not reach it) may be mid-generation and would not read its closed stdin for minutes; close(graceful=False) stops
    its whole group without waiting."""
    from data.vllm_engine import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)  # the real close() on a worker-shaped process, without starting vLLM
    engine.proc = subprocess.Popen(
        [sys.executable, "-c", WORKER],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert engine.proc.stdout is not None
    child_pid = int(engine.proc.stdout.readline())
    t0 = time.monotonic()
    engine.close(graceful=False)
    assert time.monotonic() - t0 < 10  # a graceful close would wait up to 60 s for this busy worker
    assert _wait_gone([engine.proc.pid, child_pid], timeout=5) == []
