"""Prompt-lookup / n-gram proposer (no trained drafter).

Saxena, "Prompt Lookup Decoding" (2023, github.com/apoorvumang/prompt-lookup-decoding); also the
n-gram drafting of Fu et al., "Break the Sequential Dependency of LLM Inference Using Lookahead
Decoding" (ICML 2024).  The draft is deterministic, so verification is exact (lossless) at any
temperature (delta proposals, see ``eval.sampling.verify_tree``).
"""

from __future__ import annotations

import logging

import torch

from eval.proposers.base import Proposer, TargetOutput
from eval.tree import DraftTree, chain, empty_tree

logger = logging.getLogger(__name__)

__all__ = ["PromptLookupProposer", "find_ngram_continuation"]


def find_ngram_continuation(tokens: list[int], num_tokens: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Continuation of the most recent earlier occurrence of the context's final n-gram.

    For ``n`` from ``max_ngram`` down to ``min_ngram``: take the last ``n`` tokens, search backwards
    for their most recent earlier occurrence (the suffix itself excluded) that is followed by at
    least one token, and return up to ``num_tokens`` tokens following it.  Returns ``[]`` when
    nothing matches.
    """
    t = len(tokens)
    for n in range(min(max_ngram, t - 1), min_ngram - 1, -1):
        if n <= 0:
            break
        suffix = tokens[t - n :]
        # candidate start s: tokens[s:s+n] == suffix, with s + n < t (followed by >= 1 token)
        for s in range(t - n - 1, -1, -1):
            if tokens[s : s + n] == suffix:
                return tokens[s + n : s + n + num_tokens]
    return []


class PromptLookupProposer(Proposer):
    """Propose the ``num_tokens`` tokens that followed the last n-gram's previous occurrence.

    Args:
        num_tokens: draft length ``K``.
        max_ngram: longest n-gram tried first.
        min_ngram: shortest n-gram tried.
    """

    name = "prompt_lookup"
    needs_hidden_states = False

    def __init__(self, num_tokens: int = 5, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if num_tokens < 1 or min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError(f"bad prompt lookup config K={num_tokens} n=[{min_ngram}, {max_ngram}]")
        self.num_tokens = num_tokens
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def begin(self, prompt_ids: torch.Tensor, target_out: TargetOutput) -> None:
        """Nothing to initialise (the context is searched afresh at every step)."""
        return None

    def propose(self, context: torch.Tensor) -> DraftTree:
        """A chain of up to ``num_tokens`` tokens (possibly empty)."""
        toks = find_ngram_continuation(context.reshape(-1).tolist(), self.num_tokens, self.max_ngram, self.min_ngram)
        return chain(toks) if toks else empty_tree()
