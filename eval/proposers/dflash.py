"""Proposer for DFlash block drafts (a block-diffusion draft that proposes a whole block in one forward).

The draft reads the target's hidden states of every committed position, fused into one vector per position
(``fc`` over several target layers, then a norm); each draft layer turns those into keys and values of its
attention (the *context*), which depend on nothing the draft computes, so they are cached and only extended by
the rows each verification step commits. A draft step runs the draft layers once over one block of
``block_size`` positions: the last committed token (the anchor, at the position right after the committed
context) followed by ``block_size - 1`` mask tokens. Every block position attends to the whole context and to
every block position (bidirectional inside the block); block position ``k >= 1`` gives the draft distribution of
the token ``k`` places after the anchor. The block positions' keys and values are never cached.

* ``decode=chain``: ``min(chain_k, block_size - 1)`` tokens, each position's argmax (at temperature > 0 a sample
  from its distribution ``q_k``, recorded for lossless speculative sampling; the positions do not see each
  other's drafted tokens, so ``q_k`` is a proposal that does not depend on them, as for Medusa).
* ``decode=tree``: a static tree of top-k rank paths over the block positions' distributions
  (:func:`eval.proposers.medusa.default_tree_paths` with the default rank prior), verified with tree attention.

Exact (lossless) with any draft, trained or not: the target verifies every draft token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from eval.config import Decode
from eval.proposers.base import Proposer, TargetOutput
from eval.proposers.medusa import default_tree_paths, rank_prior
from eval.tree import DraftTree, chain, empty_tree, static_tree, tree_depths

__all__ = ["BlockDraft", "DFlashProposer"]

KV = tuple[torch.Tensor, torch.Tensor]


class BlockDraft(Protocol):
    """What the proposer needs of a DFlash draft module (:class:`train.drafters.dflash.DFlashHead`)."""

    block_size: int

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``[N, S, k*H]`` concatenated target layers -> ``[N, S, H]`` context rows."""
        ...

    def context_kv(self, rows: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """Every draft layer's keys and values of context rows ``[N, S, H]`` at ``positions`` ``[N, S]``."""
        ...

    def block_logits(self, anchors: torch.Tensor, positions: torch.Tensor, ctx: list[KV]) -> torch.Tensor:
        """Target-vocabulary logits ``[N, block_size - 1, V]`` of the block after each anchor token ``[N]`` at
        ``positions`` ``[N]`` given each layer's context ``[N, kv, S, d]`` (all visible)."""
        ...


class DFlashProposer(Proposer):
    """Drafts a block at a time with a DFlash draft.

    Args:
        head: the draft (see :class:`BlockDraft`).
        cfg: the drafter config (``decode``, ``chain_k``, ``tree_depth``, ``tree_top_k``, ``tree_total_tokens``).
        feature_fn: maps a decoder hidden-state dict to the concatenated target layers ``[n, k*H]``.
        aux_hidden_layers: the target layers (HF ``hidden_states`` indices) ``feature_fn`` reads.
    """

    needs_hidden_states = True

    def __init__(
        self,
        head: Any,
        cfg: Any,
        feature_fn: Callable[[dict[int | str, torch.Tensor]], torch.Tensor],
        aux_hidden_layers: list[int],
    ) -> None:
        self.head = head.eval()
        self.mode = Decode.parse(cfg.decode, "drafter.decode")
        self.name = f"{getattr(cfg, 'name', 'dflash')}_{self.mode}"
        self.feature_fn = feature_fn
        self.aux_hidden_layers = aux_hidden_layers
        width = int(head.block_size) - 1
        self.paths: list[list[int]] = []
        if self.mode == "chain":
            self.depth = min(int(cfg.chain_k), width)
            self.chain_k = self.depth
            """What a chain really drafts (at most ``block_size - 1``), for the eval's labels and cost model."""
        else:
            depth = min(int(cfg.tree_depth), width)
            self.paths = default_tree_paths(
                rank_prior(depth, int(cfg.tree_top_k)), int(cfg.tree_total_tokens), depth, int(cfg.tree_top_k)
            )
            self.depth = max((len(p) for p in self.paths), default=0)
        self._ctx: list[KV] | None = None
        self._n = 0
        self._pending: list[torch.Tensor] = []

    def _dtype(self) -> torch.dtype:
        return next(self.head.parameters()).dtype

    def begin(self, prompt_ids: torch.Tensor, target_out: TargetOutput) -> None:
        assert target_out.hidden_states is not None, "decoder must deliver hidden states"
        self._ctx, self._n = None, 0
        self._pending = [self.feature_fn(target_out.hidden_states)]

    def commit(
        self, context: torch.Tensor, n_new: int, hidden_states_of_accepted: dict[int | str, torch.Tensor] | None
    ) -> None:
        assert hidden_states_of_accepted is not None
        self._pending.append(self.feature_fn(hidden_states_of_accepted))

    def _sync(self, context: torch.Tensor) -> list[KV]:
        """Extend the cached context keys/values with the pending rows; return them."""
        if self._pending:
            feats = torch.cat(self._pending).to(self._dtype())
            n = feats.shape[0]
            if self._n + n != context.numel() - 1:
                raise RuntimeError(f"draft has {self._n}+{n} rows for a context of {context.numel()} tokens")
            pos = torch.arange(self._n, self._n + n, device=feats.device)[None]
            new = self.head.context_kv(self.head.fuse(feats[None]), pos)
            if self._ctx is None:
                self._ctx = new
            else:
                self._ctx = [
                    (torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                    for (k0, v0), (k1, v1) in zip(self._ctx, new, strict=True)
                ]
            self._n += n
            self._pending = []
        if self._ctx is None:
            raise RuntimeError("propose() before begin()")
        return self._ctx

    @torch.inference_mode()
    def block(self, context: torch.Tensor) -> torch.Tensor:
        """The draft's logits ``[block_size - 1, V]`` for the tokens after ``context[-1]`` (float32)."""
        ctx = self._sync(context)
        dev = ctx[0][0].device
        anchor = context[-1:].to(dev)
        pos = torch.tensor([context.numel() - 1], device=dev)
        return self.head.block_logits(anchor, pos, ctx)[0].float()

    @torch.inference_mode()
    def propose(self, context: torch.Tensor) -> DraftTree:
        logits = self.block(context)
        if self.depth == 0:
            return empty_tree()
        if self.mode == "chain":
            qs: list[torch.Tensor] = []
            toks = [self.draft_token(logits[k], qs) for k in range(self.depth)]
            return chain(toks, probs=torch.stack(qs) if qs else None)
        logprobs = torch.log_softmax(logits[: self.depth], dim=-1)

        def expand_fn(tokens: torch.Tensor, parents: list[int], expand: list[int]) -> torch.Tensor:
            d = tree_depths(parents)[expand[0]] + 1  # every expanded node sits at depth d - 1
            return logprobs[d - 1].expand(len(expand), -1)

        return static_tree(self.paths, expand_fn, logprobs[0])
