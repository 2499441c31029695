"""Fixtures for the export tests: a small trained-looking EAGLE drafter directory with its run records."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="module")
def eagle_run(tmp_path_factory: pytest.TempPathFactory, target):  # -> Path (runs_root/run_name)
    """runs/<run>/train/{best/, manifest.json} and runs/<run>/eval/{metrics.json, table.md}, no training needed."""
    from train.drafters.eagle import EagleConfig, build, save

    run = tmp_path_factory.mktemp("runs") / "exp"
    torch.manual_seed(0)
    cfg = EagleConfig()
    head = build(cfg, target.model)
    with torch.no_grad():  # make the head's weights distinct from a fresh init
        for p in head.parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn_like(p))
    save(head, str(run / "train" / "best"), cfg)
    manifest = {
        "stage": "train",
        "git_commit": "abc",
        "written_at": "2026-01-01T00:00:00",
        "config": {
            "data": {"sources": {"sharegpt": {"kind": "sharegpt", "weight": 1.0}}, "heldout_fraction": 0.05},
            "train": {"micro_batch_size": 4, "grad_accum": 1, "max_seq_len": 1024, "lr": 3e-4},
            "synth": {"regenerate": True},
        },
        "inputs": {"synth_dir": "runs/exp/synth"},
        "target": {"name": "smollm2-135m", "fingerprint": target.fingerprint},
        "result": {"steps": 7, "world_size": 1, "seconds": 1.5, "best": {"tau": 1.5, "step": 7}},
    }
    (run / "train" / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    (run / "eval").mkdir()
    table = "| source | method | tau |\n|---|---|---|\n| all | eagle_chain_k5 | 1.23 |\n"
    (run / "eval" / "table.md").write_text(table, encoding="utf-8")
    (run / "eval" / "metrics.json").write_text(
        json.dumps({"settings": {"temperature": 0.0, "max_new_tokens": 64, "k": 5}, "metrics": {}}), encoding="utf-8"
    )
    return run
