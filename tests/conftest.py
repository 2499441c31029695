"""Shared fixtures: the real embedded target (converted once per machine and cached) and composed configs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")
"""One torch thread per process: the suite runs two pytest workers on CI's two cores, and every ``python -m train``
they start honours OMP_NUM_THREADS (``runtime.num_threads=0``), so the cores are not oversubscribed (the training
tests ran 6% faster than with two threads each, one run after the other on a 2-core machine)."""
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"

HEAVY_FIRST = (
    "test_train/test_faults.py",
    "test_export/test_vllm_parity.py",
    "test_eval/test_replay.py",
    "test_targets/test_architectures.py",
    "test_train/test_eagle_train.py",
    "test_cluster/test_slurm.py",
    "test_data/test_synth_vllm.py",
    "test_train/test_safety.py",
    "test_train/test_medusa.py",
    "test_train/test_deepspeed.py",
    "test_train/test_eagle3.py",
    "test_train/test_bench_gpu.py",
    "test_train/test_optim.py",
    "test_eval/test_stage_eval.py",
    "test_data/test_synth.py",
    "test_data/test_config.py",
    "test_train/test_bench_scaling.py",
    "test_train/test_standalone.py",
    "test_train/test_bench_peer.py",
    "test_export/test_export_eagle3.py",
    "test_train/test_pipeline.py",
    "test_train/test_plugin_family.py",
    "test_data/test_package.py",
)
"""Test files that take minutes on a 2-core machine, longest first (from pytest's --durations in CI runs). The
suite runs in two pytest-xdist workers, each file whole on one (``-n 2 --dist loadfile --no-loadscope-reorder``),
handed out in collection order: the long files start first and the short ones fill the end, so neither worker
idles while the other finishes a long file. The other files keep pytest's order after these."""


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].removeprefix("tests/"), len(rank)))  # stable


def compose(overrides: list[str]):  # -> Config
    """Compose the project's Hydra config with ``overrides`` and return the typed Config object."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from train.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        dcfg = hydra_compose("config", overrides=overrides)
    return OmegaConf.to_object(dcfg)


@pytest.fixture(scope="session")
def target():
    """The real embedded SmolLM2-135M target (fp32, CPU)."""
    import torch

    from data.config import TargetConfig
    from data.target import load_target

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return load_target(TargetConfig(device="cpu"))


def subprocess_env(wandb_mode: str = "offline") -> dict[str, str]:
    """Environment for ``python -m train`` subprocesses: this checkout importable, W&B in ``wandb_mode``, the
    shared target cache."""
    return dict(os.environ, WANDB_MODE=wandb_mode, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.fixture()
def run_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """Environment for ``python -m train`` subprocesses: W&B offline, the shared target cache."""
    yield subprocess_env()


SMALL_SYNTH = [
    "experiment=quickstart",
    "data.num_prompts=12",
    "data.max_heldout=2",
    "data.max_turns=1",
    "synth.max_new_tokens=24",
    "synth.chunk_size=12",
    "data.max_prompt_tokens=200",
]
"""A small synth run (12 real conversations, 2 held out per source) shared by the train and eval tests."""

TINY_SYNTH = [
    "experiment=quickstart",
    "data.num_prompts=8",
    "data.max_heldout=2",
    "data.max_turns=1",
    "synth.max_new_tokens=12",
    "data.max_prompt_tokens=200",
]
"""A smaller synth run for the tests on a tiny random target (``data.tiny_target``): seconds per stage."""


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests import cli

    out = tmp_path_factory.mktemp("synth")
    env = dict(os.environ, WANDB_MODE="disabled")
    res = cli.run(["stage=synth", *SMALL_SYNTH, f"hydra.run.dir={out}"], env, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out
