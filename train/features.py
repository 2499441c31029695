"""Stage features: precompute the target hidden states a drafter trains on, into sharded safetensors.

With ``train.features=precomputed`` the training loop reads these instead of running the (frozen) target
in every step, so several epochs cost one target pass. Files: ``part-00000.safetensors`` holding, for
each training row ``i`` of the part, tensors ``"{i}.{layer}"`` of shape ``[L_i, H]``; ``manifest.json``
names the synth plan, the target fingerprint, the layers and ``max_seq_len`` they were made with.
Parts are written atomically; a restarted run skips finished parts.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from data.atomic import atomic_write_json, atomic_write_with
from data.config import ConfigError
from data.layout import MANIFEST
from data.manifest import read_manifest, write_manifest
from data.target import load_target
from data.tracking import log_stage
from train.batches import BatchPlan, load_rows
from train.config import Config
from train.drafters import registry

logger = logging.getLogger(__name__)
ROWS_PER_PART = 256


def _check_or_write_plan(out: Path, plan: dict[str, Any], overwrite: bool) -> None:
    """Parts are reused on a rerun only when they were made from the same inputs (``plan.json``, written before
    the first part); parts of another plan are refused, or removed with ``overwrite=true``, never mixed."""

    path = out / "plan.json"
    old: dict[str, Any] | None = None
    if path.is_file():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            old = {"corrupt": str(path)}
    elif (out / MANIFEST).is_file():  # made before plan.json existed: its manifest says the same
        m = read_manifest(out / MANIFEST)
        old = {
            "synth_plan": (m.get("inputs") or {}).get("synth_plan"),
            "target_fingerprint": (m.get("target") or {}).get("fingerprint"),
            "layers": m.get("layers"),
            "rows": m.get("rows"),
            "max_seq_len": m.get("max_seq_len"),
        }
    elif list(out.glob("part-*.safetensors")):
        old = {"unknown": "parts without plan.json"}
    if old == plan:
        return
    if old is not None:
        diff = sorted(k for k in set(old) | set(plan) if old.get(k) != plan.get(k))
        if not overwrite:
            raise ConfigError(
                f"{out} holds features made from other inputs (differs in: {', '.join(diff)}). Add overwrite=true to "
                f"replace them, or set train.features_dir (hydra.run.dir) elsewhere."
            )
        logger.warning("overwrite=true: removing the features of other inputs in %s (%s)", out, ", ".join(diff))
        for f in out.glob("part-*.safetensors"):
            f.unlink()
        (out / MANIFEST).unlink(missing_ok=True)
    atomic_write_json(path, plan)


def run_features(cfg: Config, out: Path) -> dict[str, Any]:

    if cfg.drafter is None:
        raise ConfigError("stage=features needs a drafter (drafter=eagle): it decides which layers to store")
    synth = read_manifest(Path(cfg.synth_dir) / MANIFEST)
    target = load_target(cfg.target)
    if synth["target"]["fingerprint"] != target.fingerprint:
        raise ConfigError(f"synth data in {cfg.synth_dir} was made by another target; rerun stage=synth")
    spec = registry.get(cfg.drafter.name)
    layers = spec.feature_layers(cfg.drafter, target.model.config)
    rows = load_rows(cfg.synth_dir, cfg.train.max_seq_len)
    tokens = sum(len(r.input_ids) for r in rows)
    dtype = target.model.dtype
    nbytes = tokens * target.model.config.hidden_size * len(layers) * torch.finfo(dtype).bits // 8
    free = shutil.disk_usage(out.parent if out.parent.exists() else Path.cwd()).free
    logger.info(
        "features: %d rows, %d tokens, layers %s -> %.1f MB on disk (%.1f GB free)",
        len(rows),
        tokens,
        layers,
        nbytes / 1e6,
        free / 1e9,
    )
    if nbytes > free * 0.95:
        raise OSError(
            f"features need {nbytes / 1e9:.2f} GB but {out} has {free / 1e9:.2f} GB free; "
            f"use train.features=online or point train.features_dir at a larger disk"
        )
    out.mkdir(parents=True, exist_ok=True)
    _check_or_write_plan(
        out,
        {
            "synth_plan": synth.get("plan_hash"),
            "target_fingerprint": target.fingerprint,
            "layers": list(layers),
            "rows": len(rows),
            "max_seq_len": cfg.train.max_seq_len,
        },
        cfg.overwrite,
    )
    t0 = time.perf_counter()
    parts = [range(i, min(i + ROWS_PER_PART, len(rows))) for i in range(0, len(rows), ROWS_PER_PART)]
    plan = BatchPlan(rows, 1, 1, 0, target.tokenizer.pad_token_id)
    with tqdm(total=len(rows), unit="row", desc="features", mininterval=2.0) as bar:
        for p, idx in enumerate(parts):
            path = out / f"part-{p:05d}.safetensors"
            if path.is_file():
                bar.update(len(idx))
                continue
            tensors: dict[str, torch.Tensor] = {}
            order = sorted(idx, key=lambda i: len(rows[i].input_ids))
            mb = max(1, cfg.train.micro_batch_size)
            for b in range(0, len(order), mb):
                group = order[b : b + mb]
                batch = plan.collate([rows[i] for i in group], target.device)
                with torch.inference_mode():
                    hs = target.model(
                        input_ids=batch.input_ids,
                        attention_mask=batch.attention_mask,
                        output_hidden_states=True,
                        use_cache=False,
                    ).hidden_states
                for j, i in enumerate(group):
                    n = len(rows[i].input_ids)
                    for layer in layers:
                        tensors[f"{i}.{layer}"] = hs[layer][j, :n].to("cpu").contiguous()
                bar.update(len(group))
            atomic_write_with(path, lambda tmp, t=tensors: save_file(t, str(tmp)))

    manifest = write_manifest(
        out / MANIFEST,
        "features",
        cfg,
        inputs={"synth_dir": cfg.synth_dir, "synth_plan": synth.get("plan_hash")},
        target={"name": cfg.target.name, "fingerprint": target.fingerprint},
        layers=layers,
        rows=len(rows),
        tokens=tokens,
        max_seq_len=cfg.train.max_seq_len,
        parts=len(parts),
        bytes=nbytes,
        timings={"seconds": round(time.perf_counter() - t0, 2)},
    )
    log_stage(
        cfg,
        out,
        "features",
        {"rows": len(rows), "tokens": tokens, "bytes": nbytes, "layers": str(layers), "timings": manifest["timings"]},
        {"manifest": MANIFEST, "parts": "part-*.safetensors"},
    )
    return manifest


class FeatureStore:
    """Reads precomputed features row by row (memory-mapped safetensors)."""

    def __init__(
        self,
        directory: str | Path,
        synth_plan: str | None,
        fingerprint: str,
        layers: list[int],
        n_rows: int,
        max_seq_len: int,
    ) -> None:
        d = Path(directory)
        m = read_manifest(d / MANIFEST)
        problems = []
        if m["inputs"].get("synth_plan") != synth_plan:
            problems.append("they were made from other synth data")
        if m["target"]["fingerprint"] != fingerprint:
            problems.append("they were made by another target")
        if not set(layers) <= set(m["layers"]):
            problems.append(f"they hold layers {m['layers']}, the drafter needs {layers}")
        if m["rows"] != n_rows or m["max_seq_len"] != max_seq_len:
            problems.append("row count or train.max_seq_len differ")
        if problems:
            raise ConfigError(
                f"features in {d} do not fit this run: {'; '.join(problems)}. "
                f"Rerun: python3 -m train stage=features (same overrides)"
            )
        self.files = [safe_open(str(d / f"part-{p:05d}.safetensors"), "pt") for p in range(m["parts"])]
        self.layers = layers

    def get(self, row: int) -> dict[int, torch.Tensor]:
        f = self.files[row // ROWS_PER_PART]
        return {layer: f.get_tensor(f"{row}.{layer}") for layer in self.layers}
