"""Stage synth through vLLM (``synth.engine=vllm``, data/vllm_engine.py) on the real SmolLM2 target.

vLLM's rows must equal the HF engine's token for token (fp32, eager, greedy; multi-turn), a killed run must
resume to the same dataset, sampling must be reproducible per request, and every way of getting it wrong must
say so. The engine tests need the engine venv (``scripts/engine_env.sh``); they are skipped without it, unless
DRAFTSMITH_REQUIRE_ENGINE=1 (CI), where they run and fail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data.config import ConfigError, TargetConfig
from data.generate import continuous_generate
from data.render import prompt_ids
from data.synth import start_engine
from data.target import resolve_target_path
from data.vllm_engine import EngineError, VLLMEngine, find_engine_python
from tests.conftest import REPO, compose
from tests.test_data.test_synth import _rows
from tests.test_data.test_synth import _synth as synth_process

ENGINE = REPO / ".venv-engine" / "bin" / "python"
needs_engine = pytest.mark.skipif(
    not ENGINE.is_file() and os.environ.get("DRAFTSMITH_REQUIRE_ENGINE") != "1",
    reason="needs the engine venv: bash scripts/engine_env.sh",
)

SMALL = [
    "experiment=quickstart",
    "data.num_prompts=6",
    "data.max_heldout=2",
    "data.max_turns=2",
    "synth.max_new_tokens=24",
    "synth.chunk_size=1",
    "synth.batch_size=4",
    "data.max_prompt_tokens=160",
]


def test_greedy_plan_hash_ignores_the_engine_and_where_vllm_lives() -> None:
    """A resumed or resharded greedy run may switch between the fp32 engines or vLLM interpreters (rows are the
    same); bf16 or sampling rows depend on the engine, so there it counts; where vLLM is installed never does."""
    from data.synth_store import plan_hash

    def h(*o: str) -> str:
        return plan_hash(compose(list(o)), "fp", [("s", "1")])

    base = h()
    assert h("synth.engine=vllm", "synth.vllm_python=/x/python") == base
    assert h("synth.prepack=false") == base  # a kernel choice: the same rows (tests/test_data/test_prepack.py)
    assert h("synth.engine=vllm", "synth.vllm_dtype=bfloat16") != base  # bf16 may flip near-ties
    assert h("synth.temperature=0.7", "synth.engine=vllm") != h("synth.temperature=0.7")
    assert h("synth.temperature=0.7", "synth.vllm_python=/x") == h("synth.temperature=0.7")
    assert h("synth.max_new_tokens=7") != base


def test_bad_engine_settings_are_refused_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from data.config import SynthConfig
    from train.config import check_overrides

    for bad, msg in (("synth.engine=vlm", "synth.engine='vlm'"), ("synth.vllm_dtype=fp8", "synth.vllm_dtype='fp8'")):
        with pytest.raises(ConfigError, match=msg):  # on the command line, before Hydra composes
            check_overrides([bad], ())
        key, value = bad.split("=")
        with pytest.raises(ConfigError, match=msg):  # a config built in code
            SynthConfig(**{key.split(".")[1]: value})
    with pytest.raises(EngineError, match="does not exist"):
        find_engine_python(str(tmp_path / "no-python"))
    # A Python that cannot import vllm (site-packages off), named explicitly: an error, not a silent fallback.
    bare = tmp_path / "python"
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    bare.chmod(0o755)
    with pytest.raises(EngineError, match="cannot import vllm"):
        find_engine_python(str(bare))
    monkeypatch.setenv("DRAFTSMITH_VLLM_PYTHON", str(bare))
    with pytest.raises(EngineError, match="cannot import vllm"):
        find_engine_python(None)
    # engine=auto with no vLLM anywhere uses the HF engine; engine=vllm refuses with what to do.
    monkeypatch.delenv("DRAFTSMITH_VLLM_PYTHON")
    monkeypatch.setattr("data.synth.find_engine_python", lambda _named: None)
    assert start_engine(compose(["synth.engine=auto"]), None) is None  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"engine_env\.sh"):
        start_engine(compose(["synth.engine=vllm"]), None)  # type: ignore[arg-type]


@needs_engine
def test_vllm_worker_matches_hf_greedy_seeds_sampling_and_reports_errors(target) -> None:
    tok = target.tokenizer
    prompts = [
        prompt_ids(tok, [{"role": "user", "content": q}])
        for q in ("What is the capital of France?", "def fib(n):", "Write a haiku about rain, please.")
    ]
    expected, _ = continuous_generate(target.model, prompts, 20, eos_token_id=tok.eos_token_id, batch_size=2)
    with VLLMEngine(
        resolve_target_path(TargetConfig()), python=str(ENGINE), max_model_len=256, eos_token_id=tok.eos_token_id
    ) as eng:
        outs, seconds = eng.generate(prompts, 20)
        assert outs == expected and seconds > 0
        a, _ = eng.generate([prompts[0]] * 3, 16, temperature=1.0, top_p=0.95, seeds=[7, 7, 8])
        b, _ = eng.generate([prompts[0]] * 3, 16, temperature=1.0, top_p=0.95, seeds=[7, 7, 8])
        assert a == b and a[0] == a[1]  # a request's seed fixes its sample
        with pytest.raises(EngineError, match="out of vocabulary"):
            eng.generate([[10**7]], 4)
    assert eng.proc.poll() is not None  # the worker is gone after close


def _synth(run_dir: Path, env: dict[str, str], *extra: str) -> subprocess.Popen[str]:
    return synth_process(run_dir, env, *extra, small=SMALL)


@needs_engine
def test_vllm_synth_equals_hf_synth_and_resumes_after_a_kill(tmp_path: Path, run_env: dict[str, str]) -> None:
    ref_dir, vllm_dir = tmp_path / "hf", tmp_path / "vllm"
    ref = _synth(ref_dir, run_env, "synth.engine=hf")
    out, _ = ref.communicate(timeout=600)
    assert ref.returncode == 0, out
    assert json.loads((ref_dir / "manifest.json").read_text())["timings"]["engine"] == "hf"

    # vLLM, killed right after its first chunk lands, then resumed: the same rows as the HF engine's.
    vllm = ["synth.engine=vllm", f"synth.vllm_python={ENGINE}"]
    proc = _synth(vllm_dir, run_env, *vllm)
    first = vllm_dir / "data" / "chunk-00000.parquet"
    deadline = time.time() + 600
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate()
    done_before = sorted(p.name for p in (vllm_dir / "data").glob("chunk-*.parquet"))
    assert "chunk-00000.parquet" in done_before and len(done_before) < 6, out
    assert not (vllm_dir / "manifest.json").exists()
    resumed = _synth(vllm_dir, run_env, *vllm)
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out
    assert f"{len(done_before)} already done" in out
    rows, ref_rows = _rows(vllm_dir), _rows(ref_dir)
    assert [r["gen_token_ids"] for r in rows] == [r["gen_token_ids"] for r in ref_rows]
    assert rows == ref_rows
    assert any(len(r["gen_token_ids"]) == 2 for r in rows)  # second turns, conditioned on the target's answers
    timings = json.loads((vllm_dir / "manifest.json").read_text())["timings"]
    assert timings["engine"] == "vllm" and timings["engine_start_seconds"] > 0
    assert timings["generated_tokens_per_second"] > 0
