"""Training batches from synth output: length-bucketed, deterministic, addressable by index.

Micro-batch ``i`` of the run is a pure function of (dataset, seed, i), so a resumed run continues with
exactly the batches an uninterrupted run would have seen, and ``W`` processes with ``A`` accumulation
steps see the same micro-batches per optimizer step as one process with ``W * A``.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from data.layout import MANIFEST
from data.synth_store import synth_chunks
from train.drafters.registry import TrainBatch

logger = logging.getLogger(__name__)


@dataclass
class Row:
    input_ids: list[int]
    loss_mask: list[int]


def load_rows(synth_dir: str | Path, max_seq_len: int) -> list[Row]:
    """Read the synth parquet chunks; keep rows with at least one target-written token to predict."""
    import pyarrow.parquet as pq

    out = Path(synth_dir)
    if not (out / MANIFEST).is_file():
        raise FileNotFoundError(
            f"No finished synth output in {out}: run `python -m train stage=synth` (same run_name) first, "
            f"or point synth_dir at one."
        )
    files = synth_chunks(out)
    rows: list[Row] = []
    dropped = 0
    for f in files:
        for rec in pq.read_table(f, columns=["input_ids", "loss_mask"]).to_pylist():
            ids, mask = rec["input_ids"][:max_seq_len], rec["loss_mask"][:max_seq_len]
            if sum(mask[2:]) == 0:
                dropped += 1
                continue
            rows.append(Row(ids, mask))
    if not rows:
        raise ValueError(f"synth output in {out} has no rows with target-written tokens")
    logger.info("training rows: %d (%d without target tokens dropped)", len(rows), dropped)
    return rows


class BatchPlan:
    """Deterministic length-bucketed micro-batches over epochs."""

    def __init__(self, rows: list[Row], micro_batch_size: int, bucket_size: int, seed: int, pad_id: int) -> None:
        self.rows = rows
        self.mb = micro_batch_size
        self.bucket = max(1, bucket_size) * micro_batch_size
        self.seed = seed
        self.pad_id = pad_id
        self.per_epoch = (len(rows) + micro_batch_size - 1) // micro_batch_size
        self._epoch: int | None = None
        self._batches: list[list[int]] = []

    def _plan_epoch(self, epoch: int) -> list[list[int]]:
        rng = random.Random(f"{self.seed}:{epoch}")
        order = list(range(len(self.rows)))
        rng.shuffle(order)
        batches: list[list[int]] = []
        for w in range(0, len(order), self.bucket):
            window = sorted(order[w : w + self.bucket], key=lambda i: len(self.rows[i].input_ids))
            batches.extend(window[b : b + self.mb] for b in range(0, len(window), self.mb))
        rng.shuffle(batches)
        return batches

    def indices(self, i: int) -> list[int]:
        epoch, j = divmod(i, self.per_epoch)
        if epoch != self._epoch:
            self._batches, self._epoch = self._plan_epoch(epoch), epoch
        return self._batches[j % len(self._batches)]

    def batch(self, i: int, device: torch.device | str = "cpu") -> TrainBatch:
        """Micro-batch ``i`` (global index), right-padded."""
        return self.collate([self.rows[k] for k in self.indices(i)], device)

    def collate(self, rows: list[Row], device: torch.device | str = "cpu") -> TrainBatch:
        """Right-pad ``rows`` into one batch."""
        L = max(len(r.input_ids) for r in rows)
        ids = torch.full((len(rows), L), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), L), dtype=torch.long)
        loss = torch.zeros((len(rows), L), dtype=torch.long)
        for b, r in enumerate(rows):
            n = len(r.input_ids)
            ids[b, :n] = torch.tensor(r.input_ids)
            attn[b, :n] = 1
            loss[b, :n] = torch.tensor(r.loss_mask)
        return TrainBatch(ids.to(device), attn.to(device), loss.to(device))
