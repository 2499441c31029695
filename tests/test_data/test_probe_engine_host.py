"""scripts/probe_engine_host.py: the split of a decoding step between the model forward and the engine's own work,
and the forward's ATen dispatch count, on the real target at toy size."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def _probe():
    spec = importlib.util.spec_from_file_location("probe_engine_host", REPO / "scripts" / "probe_engine_host.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_engine_split_and_dispatch_count(target, synth_dir: Path) -> None:
    import data.generate as g

    probe = _probe()
    before = g.model_forward
    prompts = probe._prompts(str(synth_dir), 3)
    assert len(prompts) == 3 and all(prompts)
    r = probe.engine_split(target.model, target.tokenizer.eos_token_id, prompts, 3, 4)
    assert g.model_forward is before  # the timing wrapper is taken off again
    assert 1 <= r["decode_steps"] <= 3 and r["generated_tokens"] <= 12
    assert r["forward_ms_per_step"] > 0 and r["engine_ms_per_step"] >= 0
    d = probe.dispatch_count(target.model)
    # 30 Llama layers: thousands of ATen calls per eager forward
    assert d["aten_calls"] > 1000 and len(d["top"]) == 8
