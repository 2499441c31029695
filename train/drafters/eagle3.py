"""EAGLE-3 feature head (work in progress)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Eagle3Config:
    name: str = "eagle3"
    layer_ids: list[int] | None = None
    draft_vocab_size: int = 8192
    ttt_steps: int = 3
    ttt_decay: float = 0.8
    decode: str = "tree"
    chain_k: int = 5
    tree_depth: int = 5
    tree_top_k: int = 4
    tree_total_tokens: int = 16
