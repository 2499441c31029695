"""The held-out split and the deterministic choice of conversations from a weighted mixture.

A conversation is held out when a salted hash of its source and id falls below ``heldout_fraction``:
the assignment does not depend on file order, on how many prompts a run uses, or on the machine, so
held-out conversations are never trained on by any run with the same salt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from data.config import ConfigError, DataConfig
from data.layout import HELDOUT
from data.sources import Conversation, SkipCounter, check_sources, read_source, truncate_turns

logger = logging.getLogger(__name__)


def heldout_score(source: str, conv_id: str, salt: str) -> float:
    """A uniform number in [0, 1) derived from the salted SHA-256 of ``source:id``."""
    digest = hashlib.sha256(f"{salt}:{source}:{conv_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_heldout(source: str, conv_id: str, salt: str, fraction: float) -> bool:
    return heldout_score(source, conv_id, salt) < fraction


def source_quotas(data: DataConfig) -> dict[str, int | None]:
    """Training conversations per source: ``num_prompts`` split by normalised weight (None: all)."""
    if not data.sources:
        raise ConfigError("data.sources is empty: choose data=sharegpt|humaneval|mix|jsonl")
    for name, src in data.sources.items():
        if src.weight < 0:
            raise ConfigError(f"data.sources.{name}.weight={src.weight} must be >= 0")
    total_w = sum(s.weight for s in data.sources.values())
    if data.num_prompts is None:
        return {name: None for name in data.sources}
    if total_w <= 0:
        raise ConfigError("data.sources weights sum to 0")
    quotas = {name: int(data.num_prompts * s.weight / total_w) for name, s in data.sources.items()}
    heaviest = max(data.sources, key=lambda n: data.sources[n].weight)
    quotas[heaviest] += data.num_prompts - sum(quotas.values())
    return dict(quotas)


@dataclass
class Selection:
    train: list[Conversation] = field(default_factory=list)
    heldout: list[Conversation] = field(default_factory=list)
    available: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per source: valid training and held-out conversations available before the quota."""


def check_heldout_file(synth_dir: str | Path) -> int:
    """Check ``<synth_dir>/heldout.jsonl`` line by line (cheap, before a model loads); return its row count.

    Raises :class:`ConfigError` naming the file (and line) when it is missing, corrupt or empty.
    """
    path = Path(synth_dir) / HELDOUT
    if not path.is_file():
        raise ConfigError(f"{path} not found: run stage=synth for this run_name first (it writes the held-out split)")
    n = 0
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                rec = json.loads(raw.decode("utf-8"))
                ok = isinstance(rec, dict) and isinstance(rec.get("messages"), list) and "source" in rec
            except (UnicodeDecodeError, json.JSONDecodeError):
                ok = False
            if not ok:
                raise ConfigError(
                    f"{path}:{lineno}: corrupt held-out row (truncated or not a held-out record). Hint: rerun "
                    f"stage=synth (it rewrites heldout.jsonl), or judge another file with eval.prompts=<file>"
                )
            n += 1
    if n == 0:
        raise ConfigError(
            f"{path} is empty: the held-out split has no conversations. Raise data.heldout_fraction (or add "
            f"traffic) and rerun stage=synth, or judge another file with eval.prompts=<JSONL/Parquet file>"
        )
    return n


def check_data(data: DataConfig) -> None:
    """The cheap checks of ``data.*`` (values, source kinds, files exist), run before any model loads."""
    if not 0.0 <= data.heldout_fraction < 1.0:
        raise ConfigError(f"data.heldout_fraction={data.heldout_fraction} must be in [0, 1)")
    if data.num_prompts is not None and data.num_prompts < 1:
        raise ConfigError(f"data.num_prompts={data.num_prompts} must be >= 1 (or null: every conversation)")
    for name, src in data.sources.items():
        if src.regenerate is not None and not 0.0 <= src.regenerate <= 1.0:
            raise ConfigError(f"data.sources.{name}.regenerate={src.regenerate} must be in [0, 1] (or null)")
    source_quotas(data)
    check_sources(data)


def select(data: DataConfig, skips: SkipCounter, prompt_len: Callable[[Conversation], int] | None = None) -> Selection:
    """Read every source, split train/held-out by hash, shuffle deterministically and apply quotas.

    ``prompt_len(conv)`` gives the first prompt's length in target tokens; conversations longer than
    ``data.max_prompt_tokens`` are skipped (reason ``prompt_too_long``) while filling the quota.
    """
    if not 0.0 <= data.heldout_fraction < 1.0:
        raise ConfigError(f"data.heldout_fraction={data.heldout_fraction} must be in [0, 1)")
    quotas = source_quotas(data)
    sel = Selection()
    for name, src in data.sources.items():
        train: list[Conversation] = []
        held: list[Conversation] = []
        for conv in read_source(name, src, data, skips):
            if is_heldout(name, conv.id, data.split_salt, data.heldout_fraction):
                turns = data.heldout_max_turns or data.max_turns  # eval.turns judges each of them
                held.append(replace(conv, messages=truncate_turns(conv.messages, turns)))
            else:
                train.append(replace(conv, messages=truncate_turns(conv.messages, data.max_turns)))
        sel.available[name] = {"train": len(train), "heldout": len(held)}
        for part in (train, held):
            part.sort(key=lambda c: c.id)
            random.Random(f"{data.shuffle_seed}:{name}").shuffle(part)

        def take(pool: list[Conversation], limit: int | None, name: str = name) -> list[Conversation]:
            out: list[Conversation] = []
            for conv in pool:
                if limit is not None and len(out) >= limit:
                    break
                if prompt_len is not None and prompt_len(conv) > data.max_prompt_tokens:
                    skips.add(name, "prompt_too_long")
                    continue
                out.append(conv)
            return out

        chosen = take(train, quotas[name])
        if quotas[name] is not None and len(chosen) < quotas[name]:
            logger.warning("source %s: wanted %d training conversations, found %d", name, quotas[name], len(chosen))
        sel.train.extend(chosen)
        sel.heldout.extend(take(held, data.max_heldout))
    if not sel.heldout:
        read = sum(v["train"] + v["heldout"] for v in sel.available.values())
        logger.warning(
            "the held-out split is empty: %d valid conversations read (%s), data.heldout_fraction=%s puts none of "
            "them in it. Training runs without held-out checks (best/ = the last checkpoint) and stage eval needs "
            "other prompts (eval.prompts=<file>); raise data.heldout_fraction or add traffic for a held-out split.",
            read,
            ", ".join(f"{n}: {v['train'] + v['heldout']}" for n, v in sel.available.items()),
            data.heldout_fraction,
        )
    ids = [(c.source, c.id) for c in sel.train]
    if len(set(ids)) != len(ids):
        dupes = len(ids) - len(set(ids))
        logger.warning("%d duplicate conversation ids in the training selection; keeping the first of each", dupes)
        seen: set[tuple[str, str]] = set()
        sel.train = [c for c in sel.train if not ((c.source, c.id) in seen or seen.add((c.source, c.id)))]
    return sel
