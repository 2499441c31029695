"""Held-out prompts and the acceptance measurement shared by stage eval and the training loop's checks."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from data.render import prompt_ids
from eval.decoder import SpeculativeDecoder
from eval.metrics import DecodeStats
from eval.proposers.base import Proposer

logger = logging.getLogger(__name__)


@dataclass
class Prompt:
    source: str
    id: str
    input_ids: list[int]


def load_heldout(synth_dir: str | Path, tokenizer: Any, per_source: int, max_prompt_tokens: int = 1024) -> list[Prompt]:
    """The first user turn of up to ``per_source`` held-out conversations of each source."""
    path = Path(synth_dir) / "heldout.jsonl"
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
        msgs = rec["messages"]
        first_user = next(i for i, m in enumerate(msgs) if m["role"] == "user")
        ids = prompt_ids(tokenizer, msgs[: first_user + 1])
        if len(ids) > max_prompt_tokens:
            continue
        counts[src] = counts.get(src, 0) + 1
        prompts.append(Prompt(src, str(rec["id"]), ids))
    if not prompts:
        raise ValueError(f"no usable held-out prompts in {path}")
    return prompts


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
