"""Stage synth's output on disk: the rows' Parquet schema, the plan that names what the data depends on (a rerun
with another plan is refused, not mixed in), and the readers that check a finished output against its manifest
before any stage reads it (a missing, damaged or cut-short chunk or held-out split is refused, naming the file).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

from data.atomic import atomic_write_json, atomic_write_with
from data.config import ConfigError, RunConfig, flat_config, shown_value
from data.layout import CHUNK_GLOB, MANIFEST, SYNTH_DATA, SYNTH_STATS, chunk_path, heldout_path
from data.manifest import read_manifest
from data.split import check_heldout_file

logger = logging.getLogger(__name__)


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            ("id", pa.string()),
            ("source", pa.string()),
            ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("input_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.int8())),
            ("gen_token_ids", pa.list_(pa.list_(pa.int32()))),
            ("num_target_tokens", pa.int64()),
        ]
    )
    table = pa.Table.from_pylist(rows, schema=schema)
    atomic_write_with(path, lambda tmp: pq.write_table(table, tmp))


def plan_hash(cfg: RunConfig, fingerprint: str, ids: list[tuple[str, str]]) -> str:
    """Everything that determines the dataset's content (not how it is split across shards)."""
    inputs = plan_inputs(cfg, fingerprint, ids)
    blob = json.dumps(inputs, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def plan_inputs(cfg: RunConfig, fingerprint: str, ids: list[tuple[str, str]]) -> dict[str, Any]:
    """What :func:`plan_hash` hashes; ``plan.json`` keeps it (the ids as a digest) to name what changed."""
    synth = asdict(cfg.synth)
    for k in ("num_shards", "shard_index", "batch_size"):
        synth.pop(k)
    synth.pop("vllm_python")  # where vLLM lives, not what it makes
    synth.pop("prepack")  # a kernel choice: the same sums in another order, as batch_size (BENCHMARKS)
    synth.pop("share_prefix")  # likewise: the same keys and values, computed once per group instead of per row
    if cfg.synth.temperature == 0:
        synth.pop("engine")  # greedy rows are the same with every engine (fp32, eager: tested) ...
        if synth["vllm_dtype"] == "float32" and synth["vllm_eager"]:
            synth.pop("vllm_dtype")  # ... unless vLLM runs in lower precision or compiled (near-ties may flip);
            synth.pop("vllm_eager")  # the defaults hash as before these settings existed
    data = asdict(cfg.data)
    data.pop("heldout_max_turns")  # the held-out split's turns: no training row depends on them
    for src in data["sources"].values():
        if src.get("regenerate") is None:
            src.pop("regenerate", None)  # unset: hashes as before the setting existed
    return {"data": data, "synth": synth, "target": fingerprint, "ids": ids, "seed": cfg.seed}


def stored_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    ids = json.dumps(inputs["ids"]).encode()
    return {**inputs, "ids": f"{len(inputs['ids'])} conversations, sha256 {hashlib.sha256(ids).hexdigest()[:16]}"}


def _plan_changes(old: dict[str, Any], new: dict[str, Any]) -> str:
    """The keys whose values differ between two stored plan inputs, as ``key: old -> new``."""
    a, b = flat_config(old.get("inputs") or {}), flat_config(new["inputs"])
    names = {"target": "target (fingerprint)", "ids": "the selected conversations"}
    diff = [
        f"{names.get(k, k)}: {shown_value(a.get(k, '<unset>'))} -> {shown_value(b.get(k, '<unset>'))}"
        for k in sorted(set(a) | set(b))
        if a.get(k, "<unset>") != b.get(k, "<unset>")
    ]
    return "; ".join(diff[:8]) + ("; ..." if len(diff) > 8 else "")


def check_or_write_plan(out: Path, plan: dict[str, Any], overwrite: bool) -> None:
    path = out / "plan.json"
    if path.is_file():
        old = json.loads(path.read_text(encoding="utf-8"))
        if old.get("hash") == plan["hash"]:
            return
        if not overwrite:
            changes = _plan_changes(old, plan) if old.get("inputs") else f"plan {old.get('hash')} vs {plan['hash']}"
            raise ConfigError(
                f"{out} holds synth output made with a different config ({changes}). Use another run_name (or "
                f"synth_dir), or overwrite=true to replace it."
            )
        logger.warning("overwrite=true: removing synth output of another config in %s", out)
        shutil.rmtree(out / SYNTH_DATA, ignore_errors=True)
        shutil.rmtree(out / SYNTH_STATS, ignore_errors=True)
        (out / MANIFEST).unlink(missing_ok=True)
    atomic_write_json(path, plan)


def synth_chunks(synth_dir: str | os.PathLike[str]) -> list[Path]:
    """The data chunks of a finished synth output, checked against its manifest before anything reads them.

    A chunk that is missing, unreadable or holds another number of rows than the manifest counts (a copy cut
    short, a file replaced) is a :class:`ConfigError` naming it: training on the rest would silently learn from
    less data than the run reports.
    """
    import pyarrow.parquet as pq

    out = Path(synth_dir)
    manifest = read_manifest(out / MANIFEST)
    counts = manifest.get("counts") or {}
    n_chunks, n_rows = counts.get("chunks"), counts.get("rows")
    if not isinstance(n_chunks, int) or not isinstance(n_rows, int):
        raise ConfigError(f"{out / MANIFEST} has no chunk and row counts: rerun stage=synth (overwrite=true)")
    files = [chunk_path(out, i) for i in range(n_chunks)]
    extra = sorted(set((out / SYNTH_DATA).glob(CHUNK_GLOB)) - set(files))
    if extra:
        raise ConfigError(f"{extra[0]} is not part of the synth output in {out} ({n_chunks} chunks): remove it")
    rows = 0
    for f in files:
        if not f.is_file():
            raise ConfigError(
                f"{f} is missing from the synth output in {out}: rerun stage=synth with the same config (it writes "
                f"the missing chunks again)"
            )
        try:
            rows += pq.ParquetFile(f).metadata.num_rows
        except Exception as exc:  # pyarrow raises several types for a damaged file
            raise ConfigError(
                f"{f} is not a readable Parquet file ({type(exc).__name__}): remove it and rerun stage=synth with "
                f"the same config (it writes the missing chunk again)"
            ) from None
    if rows != n_rows:
        raise ConfigError(
            f"the synth output in {out} holds {rows} rows where its manifest counts {n_rows}: a chunk was replaced "
            f"or cut short; rerun stage=synth (overwrite=true)"
        )
    return files


def check_synth_output(synth_dir: str | os.PathLike[str]) -> list[Path]:
    """A finished synth output as its manifest describes it: every chunk (:func:`synth_chunks`) and the held-out
    split's rows, each readable, as many as counted -- checked before a stage that reads it loads a model; returns
    the chunks. A cut-short ``heldout.jsonl`` would otherwise pick ``best/`` on fewer prompts than reported."""
    out = Path(synth_dir)
    files = synth_chunks(out)
    heldout = (read_manifest(out / MANIFEST).get("counts") or {}).get("heldout")
    if isinstance(heldout, int) and heldout > 0:
        n = check_heldout_file(out)
        if n != heldout:
            raise ConfigError(
                f"{heldout_path(out)} holds {n} held-out rows where the synth manifest counts {heldout}: rerun "
                f"stage=synth with the same config (it rewrites heldout.jsonl)"
            )
    return files


def load_synth_dataset(synth_dir: str | os.PathLike[str]) -> Any:
    """Load the synth output as a ``datasets.Dataset`` (its chunks checked first: :func:`synth_chunks`)."""
    import datasets

    files = [str(f) for f in synth_chunks(synth_dir)]
    return datasets.load_dataset("parquet", data_files=files, split="train")
