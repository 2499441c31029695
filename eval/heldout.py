"""Held-out prompts and the acceptance measurement shared by stage eval and the training loop's checks."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from data.config import ConfigError, SourceConfig
from data.layout import HELDOUT
from data.render import prompt_ids
from data.sources import Skip, _records_from_file, normalise_messages, source_files
from eval.decoder import SpeculativeDecoder
from eval.metrics import DecodeStats
from eval.proposers.base import Proposer

logger = logging.getLogger(__name__)


@dataclass
class Prompt:
    source: str
    id: str
    input_ids: list[int]
    turn: int = 1
    """Which user turn of its conversation this prompt ends with (1 = the first; the earlier turns and their
    answers are its context)."""


def turn_prompts(
    tokenizer: Any, source: str, cid: str, messages: list[dict[str, str]], turns: str, max_prompt_tokens: int
) -> list[Prompt]:
    """One conversation's prompts to judge: the history up to and including each chosen user turn (``turns``:
    first | last | all), rendered with the chat template; those over ``max_prompt_tokens`` are left out. The first
    turn keeps the conversation's id (caches and paired comparisons see the same prompt as before turns were
    judged); turn t > 1 is ``<id>#t<t>``."""
    users = list(enumerate((i for i, m in enumerate(messages) if m["role"] == "user"), 1))  # (turn, index)
    chosen = {"first": users[:1], "last": users[-1:], "all": users}[str(turns)]
    out = []
    for t, i in chosen:
        ids = prompt_ids(tokenizer, messages[: i + 1])
        if len(ids) <= max_prompt_tokens:
            out.append(Prompt(source, cid if t == 1 else f"{cid}#t{t}", ids, t))
    return out


def load_heldout(
    synth_dir: str | Path, tokenizer: Any, per_source: int, max_prompt_tokens: int = 1024, turns: str = "first"
) -> list[Prompt]:
    """Prompts of up to ``per_source`` held-out conversations of each source: each conversation's first user turn,
    or its last, or every turn (``turns``; see :func:`turn_prompts`). A conversation none of whose chosen turns fits
    ``max_prompt_tokens`` is passed over."""
    path = Path(synth_dir) / HELDOUT
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: run stage=synth for this run_name first (it writes the held-out split)"
        )
    counts: dict[str, int] = {}
    prompts: list[Prompt] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        src = rec["source"]
        if counts.get(src, 0) >= per_source:
            continue
        mine = turn_prompts(tokenizer, src, str(rec["id"]), rec["messages"], turns, max_prompt_tokens)
        if mine:
            counts[src] = counts.get(src, 0) + 1
            prompts.extend(mine)
    if not prompts:
        raise ValueError(f"no usable held-out prompts in {path}")
    return prompts


def traffic_prompts(
    pattern: str,
    tokenizer: Any,
    per_source: int,
    max_prompt_tokens: int,
    max_chars: int = 20000,
    turns: str = "first",
    max_turns: int = 64,
) -> tuple[list[Prompt], dict[str, int]]:
    """Every row of a JSONL / Parquet traffic file (or glob) as prompts to judge, grouped by its ``source``
    (or ``domain``) field when it has one (else by the file's stem); at most ``per_source`` rows per group.

    Rows carry OpenAI-style ``messages`` (a prompt is everything up to a user turn: the first, the last or each,
    by ``turns``, within the first ``max_turns``) or a ``prompt`` string. Rows that cannot be used are skipped and
    counted by reason (returned with the prompts).
    """

    files = source_files("eval", SourceConfig(kind="jsonl", paths=[pattern]), key="eval.prompts")
    skipped: dict[str, int] = {}
    counts: dict[str, int] = {}
    prompts: list[Prompt] = []
    for f in files:
        for n, rec in enumerate(_records_from_file(f), 1):
            try:
                if isinstance(rec, Skip):
                    raise rec
                if not isinstance(rec, dict):
                    raise Skip("not_an_object")
                raw = rec.get("messages")
                if raw is None and isinstance(rec.get("prompt"), str):
                    raw = [{"role": "user", "content": rec["prompt"]}]
                msgs = normalise_messages(raw, max_chars, 1, max_turns if turns != "first" else None)
                src = rec.get("source", rec.get("domain", f.stem))
                src = str(src) if isinstance(src, str | int) and str(src) else f.stem
                if counts.get(src, 0) >= per_source:
                    continue
                mine = turn_prompts(tokenizer, src, str(rec.get("id", f"{f.name}:{n}")), msgs, turns, max_prompt_tokens)
                if not mine:
                    raise Skip("prompt_too_long")
            except Skip as s:
                skipped[s.reason] = skipped.get(s.reason, 0) + 1
                continue
            counts[src] = counts.get(src, 0) + 1
            prompts.extend(mine)
    if skipped:
        logger.warning("eval.prompts=%s: skipped rows by reason: %s", pattern, skipped)
    if not prompts:
        raise ConfigError(f"eval.prompts={pattern!r}: no usable prompts in {len(files)} file(s) (skipped: {skipped})")
    return prompts, skipped


def measure(
    target_model: torch.nn.Module,
    proposer: Proposer,
    prompts: list[Prompt],
    max_new_tokens: int,
    eos_token_id: int | list[int] | None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    desc: str | None = None,
) -> tuple[dict[str, DecodeStats], dict[str, list[int]]]:
    """Decode every prompt with ``proposer``; return stats per source (and ``"all"``) and the outputs."""
    decoder = SpeculativeDecoder(target_model, proposer, temperature=temperature, top_p=top_p)
    per_source: dict[str, list[DecodeStats]] = {}
    outputs: dict[str, list[int]] = {}
    for p in tqdm(prompts, desc=desc or proposer.name, unit="prompt", leave=False, mininterval=5.0):
        gen = torch.Generator().manual_seed(seed) if temperature > 0 else None
        res = decoder.generate(torch.tensor([p.input_ids]), max_new_tokens, eos_token_id, gen)
        per_source.setdefault(p.source, []).append(res.stats)
        outputs[f"{p.source}:{p.id}"] = res.tokens
    merged = {src: DecodeStats.merge_all(s) for src, s in per_source.items()}
    merged["all"] = DecodeStats.merge_all([s for lst in per_source.values() for s in lst])
    return merged, outputs
