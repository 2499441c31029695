"""A small standalone draft model distilled from the target (work in progress: see issue 5)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StandaloneConfig:
    """A small causal LM with the target's tokenizer, distilled on the synth data."""

    name: str = "standalone"
    init: str = "target"
    """target (embeddings, LM head and ``layer_ids`` copied from the target) | scratch | pretrained
    (an existing HF causal LM at ``pretrained_path`` with the target's tokenizer)."""
    pretrained_path: str | None = None
    num_layers: int = 4
    layer_ids: list[int] | None = None
    """Target layers copied when init=target (default: evenly spaced, first and last included)."""
    hidden_size: int | None = None
    """None = the target's (required for init=target)."""
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    loss: str = "kl"
    """kl (forward KL to the target's next-token distribution) | tv (total variation) | kl_tv (sum)."""
    freeze_embeddings: bool = True
    gradient_checkpointing: bool = True
    decode: str = "tree"
    chain_k: int = 5
    tree_depth: int = 5
    tree_top_k: int = 4
    tree_total_tokens: int = 16
