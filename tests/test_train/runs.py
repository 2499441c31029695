"""Helpers shared by the training tests: run stage train in a subprocess, read its losses, and check that a
run killed with SIGKILL after a checkpoint and resumed ends exactly like an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests import cli
from tests.conftest import REPO


def run_train(
    args: list[str], env: dict[str, str], launcher: list[str] | None = None
) -> cli.Forked | subprocess.Popen[str]:
    """``python -m train *args`` (stderr into stdout), or ``launcher -m train *args`` (e.g. torchrun), in its own
    process group: a SIGKILL to the group takes a launcher's workers with it, as a node failure would."""
    if launcher is None:
        return cli.start(args, env, merge_stderr=True)
    return subprocess.Popen(
        [*launcher, "-m", "train", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def ok(proc: cli.Forked | subprocess.Popen[str], timeout: int = 900) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def losses(run_dir: Path) -> list[float]:
    return [loss for _, loss in json.loads((run_dir / "manifest.json").read_text())["losses"]]


def assert_kill_resume_exact(
    base: list[str],
    reference: Path,
    killed: Path,
    env: dict[str, str],
    last_step: int,
    kill_after: int = 2,
    launcher: list[str] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Start ``base`` into ``killed``, SIGKILL it once the step-``kill_after`` checkpoint is complete, check a plain
    rerun is refused, resume with ``resume=true``, and compare losses and the step-``last_step`` drafter weights
    with the uninterrupted run in ``reference``. Returns both weight dicts for family-specific checks.
    ``launcher``: how the processes start (torchrun for several; SIGKILL goes to it, which takes its workers)."""
    proc = run_train([*base, f"hydra.run.dir={killed}"], env, launcher)
    ckpt = killed / "checkpoints" / f"step-{kill_after:06d}" / "trainer_state.json"
    deadline = time.time() + 600
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert ckpt.exists() and not (killed / "manifest.json").exists()
    refused = run_train([*base, f"hydra.run.dir={killed}"], env, launcher)
    out, _ = refused.communicate(timeout=600)
    assert refused.returncode != 0 and "resume=true" in out  # never silently overwrites a run
    out = ok(run_train([*base, f"hydra.run.dir={killed}", "resume=true"], env, launcher))
    assert "resumed from" in out
    assert losses(killed) == pytest.approx(losses(reference), rel=1e-6)
    name = f"step-{last_step:06d}"
    a = load_file(str(reference / "checkpoints" / name / "drafter" / "model.safetensors"))
    b = load_file(str(killed / "checkpoints" / name / "drafter" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), rtol=1e-5, atol=1e-7), k
    return a, b


def assert_greedy_identity(target, make_proposer, texts: tuple[str, ...], max_new_tokens: int = 20) -> None:
    """Speculative decoding with ``make_proposer()`` gives exactly the target's own greedy ``generate`` output."""
    from data.render import prompt_ids
    from eval.decoder import SpeculativeDecoder

    tok = target.tokenizer
    for text in texts:
        ids = torch.tensor([prompt_ids(tok, [{"role": "user", "content": text}])])
        ref = target.model.generate(
            ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=tok.pad_token_id,
        )[0, ids.shape[1] :].tolist()
        res = SpeculativeDecoder(target.model, make_proposer()).generate(
            ids, max_new_tokens, eos_token_id=tok.eos_token_id
        )
        assert res.tokens == ref[: len(res.tokens)] and len(res.tokens) == len(ref)
        assert res.stats.verify_steps >= 1
