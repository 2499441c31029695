"""Medusa-1 heads (work in progress: being implemented; see issue 5)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MedusaConfig:
    """Medusa heads on the frozen target's last hidden state, and their decoding settings."""

    name: str = "medusa"
    num_heads: int = 4
    """K heads; head k (1-based) predicts token t+k+1 from the target's hidden state at t."""
    num_layers: int = 1
    """Residual blocks per head: ``x + SiLU(Linear(x))``."""
    own_lm_head: bool = False
    """False: every head reuses the target's frozen LM head (Medusa version 2). True: each head has its own
    vocabulary projection, initialised from the target's."""
    loss_decay: float = 0.8
    """Loss weight of head k is ``loss_decay ** (k - 1)`` (Medusa's lambda_k)."""
    decode: str = "tree"
    """tree (static Medusa tree of top-k paths) | chain (top-1 of each head)."""
    chain_k: int = 4
    tree_depth: int = 4
    tree_top_k: int = 8
    """Largest top-k rank the default tree may use at any depth."""
    tree_total_tokens: int = 16
    """Nodes in the default tree (chosen from the heads' measured top-k accuracies)."""
    tree_paths: list[list[int]] | None = None
    """Explicit static tree (Medusa top-k index paths, e.g. [[0], [1], [0, 0]]); None = the default tree."""
