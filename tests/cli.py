"""``python -m train`` in a child process for the tests, started by a fork server when it can be.

Every test that runs a stage as a user would runs it in its own process: exit codes, one-line errors on stderr,
SIGKILL and Ctrl-C, nothing shared with pytest. Most of such a process's life on a small stage is spent importing
torch, transformers and the project (~5 s on a 2-core CPU; the suite starts a few hundred of them). So a test's
child is forked from a *zygote*: a process that imported those modules once (and nothing else: it runs no torch
operation, starts no thread, reads no config) and then forks one child per command. The child is a new process
like any other: its own pid, session and process group, its environment, working directory, argv, stdin
(``/dev/null``), stdout and stderr (files the caller reads back), and it runs ``train`` as ``python -m train`` does
(``runpy``, ``__main__``). Its exit status is the real one: an exit code, or minus the signal that ended it.

What a fork cannot give is a different *import-time* environment (the OpenMP and oneDNN variables that torch reads
when it loads, ``PYTHONPATH``, the Hugging Face variables transformers reads on import): a command whose
environment differs from the zygote's in one of those, or that runs elsewhere than the checkout, starts a real
``python -m train`` instead. ``DRAFTSMITH_TEST_FORK=0`` turns the fork server off for a whole run.

The zygote speaks over two pipes: JSON requests in (``args``, ``env``, ``cwd``, ``stdout``/``stderr`` paths,
``prelude``), JSON lines out (``{"id", "pid"}`` once forked, ``{"id", "status"}`` once reaped).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

IMPORT_TIME = ("OMP_", "GOMP_", "KMP_", "MKL_", "HF_", "HUGGINGFACE", "TRANSFORMERS_", "TORCH_LOGS", "LD_")
IMPORT_TIME += ("PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONOPTIMIZE", "PYTHONSAFEPATH", "DRAFTSMITH_DRAFTERS")
"""Environment variables read while the zygote's modules load (OpenMP's when torch loads it, the Hugging Face hub's
constants, the interpreter's start-up options; ``PYTHONPATH`` is compared apart): a command whose environment
differs from the zygote's in one of them runs as a real ``python -m train``. What is read later (oneDNN's cache size,
W&B's mode, the fault injection's) the child reads from its own environment, as a real process does."""

PRELOAD = ("train.__main__", "data.synth", "train.loop", "eval.run", "train.export.stage", "tests.faults")
"""What the zygote imports: the entry point, each stage's module and the fault-injection helpers."""


def _import_env(env: Mapping[str, str]) -> dict[str, str]:
    out = {k: v for k, v in env.items() if k.startswith(IMPORT_TIME) and k != "PYTHONPATH"}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != REPO]
    out["PYTHONPATH"] = os.pathsep.join(paths)
    return out


# ----------------------------------------------------------------------------------------------------- zygote side


def _serve(inp: int, out: int) -> dict[str, Any] | None:
    """The zygote's loop: fork a child per request, report pids and exit statuses. Returns in a child only (its
    request); returns None in the zygote when the client closes the pipe."""
    children: dict[int, int] = {}  # pid -> request id
    buf = b""
    while True:
        ready, _, _ = select.select([inp], [], [], 0.05)
        if ready:
            chunk = os.read(inp, 65536)
            if not chunk:  # the client is gone: so are the children it did not wait for (a failed test's)
                for pid in children:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                return None
            buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                os.close(inp)
                os.close(out)
                return req
            children[pid] = req["id"]
            os.write(out, (json.dumps({"id": req["id"], "pid": pid}) + "\n").encode())
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                os.write(out, (json.dumps({"id": children.pop(pid), "status": code}) + "\n").encode())


def _become(req: dict[str, Any]) -> None:
    """In the forked child: take the request's process setting, then run it as ``python -m train`` would."""
    import runpy

    os.setsid()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = ["-m", *req["args"]]
    if req.get("prelude"):
        module, _, func = req["prelude"].partition(":")
        getattr(__import__(module, fromlist=[func]), func)()
    sys.modules.pop("train.__main__", None)  # preloaded for its imports; ``python -m`` runs it as __main__ only
    runpy.run_module("train", run_name="__main__", alter_sys=True)


def zygote_main() -> None:
    inp, out = int(sys.argv[1]), int(sys.argv[2])
    for name in PRELOAD:
        __import__(name)
    # What the zygote holds lives as long as any child: out of the collector's sight, a child's collections (and the
    # several at its exit) walk only what the child made (gc.freeze's documented use before fork).
    gc.freeze()
    os.write(out, (json.dumps({"env": dict(os.environ)}) + "\n").encode())  # with what the imports set
    req = _serve(inp, out)
    if req is not None:
        _become(req)


# ----------------------------------------------------------------------------------------------------- client side


class _Server:
    """One zygote per pytest process, started on first use."""

    def __init__(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
        c_in, s_out = os.pipe()
        s_in, c_out = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import tests.cli as c; c.zygote_main()", str(s_in), str(s_out)],
            cwd=REPO,
            env=env,
            pass_fds=(s_in, s_out),
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        os.close(s_in)
        os.close(s_out)
        self.wfd, self.rfile = c_out, os.fdopen(c_in, "rb")
        ready = self.rfile.readline()
        if not ready:
            raise RuntimeError("the test fork server did not start")
        after = json.loads(ready)["env"]
        self.defaults = {k: v for k, v in after.items() if k not in env}
        """What the zygote's imports set where the environment did not (``train.__main__``'s defaults, torch's):
        a real ``python -m train`` sets the same where its command's environment does not."""
        self.env = _import_env(after)
        self.lock = threading.Lock()
        self.cond = threading.Condition()
        self.pids: dict[int, int] = {}
        self.status: dict[int, int] = {}
        self.next_id = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.rfile:
            msg = json.loads(line)
            with self.cond:
                (self.status if "status" in msg else self.pids)[msg["id"]] = msg.get("status", msg.get("pid"))
                self.cond.notify_all()

    def can_fork(self, env: Mapping[str, str]) -> bool:
        """Whether a real process with ``env`` would load its modules as the zygote did."""
        return _import_env({**self.defaults, **env}) == self.env

    def start(self, req: dict[str, Any]) -> tuple[int, int]:
        with self.lock:
            self.next_id += 1
            rid = req["id"] = self.next_id
            os.write(self.wfd, (json.dumps(req) + "\n").encode())
        with self.cond:
            self.cond.wait_for(lambda: rid in self.pids, timeout=60)
        if rid not in self.pids:
            raise RuntimeError("the test fork server did not fork")
        return rid, self.pids[rid]

    def wait(self, rid: int, timeout: float | None) -> int | None:
        with self.cond:
            self.cond.wait_for(lambda: rid in self.status, timeout=timeout)
            return self.status.get(rid)

    def close(self) -> None:
        os.close(self.wfd)
        self.proc.wait(timeout=60)


_SERVER: _Server | None = None


def _server() -> _Server | None:
    global _SERVER
    if os.environ.get("DRAFTSMITH_TEST_FORK", "1") == "0":
        return None
    if _SERVER is None:
        _SERVER = _Server()
        atexit.register(_SERVER.close)
    return _SERVER


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""


class Forked:
    """A forked ``python -m train``, with the part of :class:`subprocess.Popen` the tests use."""

    def __init__(self, server: _Server, args: list[str], env: dict[str, str], cwd: Path, merge: bool, prelude: str):
        self._dir = tempfile.TemporaryDirectory(prefix="train-cli-")
        self._out = Path(self._dir.name) / "stdout"
        self._err = self._out if merge else Path(self._dir.name) / "stderr"
        self._server, self._merge = server, merge
        self.args = args
        req = {"args": args, "env": env, "cwd": str(cwd), "stdout": str(self._out), "stderr": str(self._err)}
        self._id, self.pid = server.start({**req, "prelude": prelude})
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.wait(self._id, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.wait(self._id, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        self.wait(timeout)
        return _read(self._out), None if self._merge else _read(self._err)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(
    args: list[str],
    env: Mapping[str, str] | None = None,
    *,
    cwd: Path = REPO,
    merge_stderr: bool = False,
    prelude: str = "",
) -> Forked | subprocess.Popen[str]:
    """``python -m train *args`` in its own session (a group SIGKILL takes all of it), output captured (stderr
    into stdout with ``merge_stderr``). ``prelude``: ``"module:function"`` called first, in the child."""
    env = dict(os.environ if env is None else env)
    server = _server()
    if server is not None and Path(cwd).resolve() == REPO and server.can_fork(env):
        return Forked(server, list(args), env, Path(cwd), merge_stderr, prelude)
    if prelude:
        module, _, func = prelude.partition(":")
        code = f"import {module} as m, runpy; m.{func}(); runpy.run_module('train', run_name='__main__', alter_sys=1)"
        cmd = [sys.executable, "-c", code, *args]
    else:
        cmd = [sys.executable, "-m", "train", *args]
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # Python then raises KeyboardInterrupt
    )


def run(
    args: list[str], env: Mapping[str, str] | None = None, *, cwd: Path = REPO, timeout: float = 600, prelude: str = ""
) -> subprocess.CompletedProcess[str]:
    """``python -m train *args`` to its end, as :func:`subprocess.run` with ``capture_output=True, text=True``."""
    proc = start(args, env, cwd=cwd, prelude=prelude)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return subprocess.CompletedProcess(proc.args, proc.wait(), out, err or "")
