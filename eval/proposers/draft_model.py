"""Standalone draft-model proposer (Leviathan et al., ICML 2023; Chen et al., 2023).

Any HF causal LM sharing the target's vocabulary.  It keeps its own KV cache (``DynamicCache``):
before drafting, the cache is cropped to the longest common prefix of the tokens it holds and the
current context, and the missing context tokens are fed (this covers the rejected-draft rollback
and the target's correction / bonus token in one mechanism).

Modes:

* ``"chain"``: ``num_tokens`` tokens, greedy at temperature 0, otherwise sampled from
  ``q = logits_to_probs(draft_logits, T, top_p)`` with ``q`` returned in ``DraftTree.draft_probs``
  (speculative sampling -- exact / lossless).
* ``"tree"``: EAGLE-2 style dynamic tree (``eval.tree.dynamic_tree``) of top-k expansions ranked by
  cumulative draft log-prob (temperature-1 log-softmax, used only for ranking); deterministic nodes,
  verified with delta proposals -- exact (lossless) at any temperature.
* ``"static"``: a Medusa-style static tree given as top-k index paths (``eval.tree.static_tree``).

Tree expansions run the frontier nodes through the draft with a 4D tree attention mask (same
mechanism as the target's verification, see ``eval.decoder``), so the draft needs ``sdpa`` or
``eager`` attention for tree modes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal

import torch

from data.modeling import crop_cache, model_forward, new_cache
from eval.proposers.base import Proposer, TargetOutput
from eval.tree import (
    TREE_ATTN_IMPLEMENTATIONS,
    DraftTree,
    chain,
    dynamic_tree,
    static_tree,
    tree_attention_mask,
    tree_depths,
)

logger = logging.getLogger(__name__)

__all__ = ["DraftModelProposer", "check_vocab_compatibility"]


def _model_vocab_size(model: torch.nn.Module) -> int:
    cfg = model.config
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return int(text_cfg.vocab_size)


def check_vocab_compatibility(
    target_vocab_size: int,
    draft_vocab_size: int,
    target_tokenizer: Any | None = None,
    draft_tokenizer: Any | None = None,
) -> None:
    """Raise ``ValueError`` unless the draft can propose tokens in the target's id space.

    * With both tokenizers given, their vocabularies (``get_vocab()``) must be identical.
    * The logit sizes must be equal, except when the tokenizers are given, identical and fit in
      both (``len(tokenizer) <= min`` of the sizes) -- then only the embedding padding differs (e.g.
      Qwen2.5-0.5B vs 7B) and the draft logits are cut / padded with ``-inf`` to the target's size.
    """
    same_tokenizer: bool | None = None
    if target_tokenizer is not None and draft_tokenizer is not None:
        tv, dv = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        if tv != dv:
            diff = sorted(set(tv.items()) ^ set(dv.items()))[:5]
            raise ValueError(
                f"draft tokenizer is incompatible with the target tokenizer ({len(dv)} vs {len(tv)} entries, "
                f"e.g. differing (token, id) pairs {diff}); speculative decoding needs a shared vocabulary"
            )
        same_tokenizer = True
    if draft_vocab_size != target_vocab_size:
        if same_tokenizer and len(target_tokenizer) <= min(draft_vocab_size, target_vocab_size):
            logger.info(
                "draft vocab %d != target vocab %d but tokenizers match; adapting draft logits",
                draft_vocab_size,
                target_vocab_size,
            )
            return
        raise ValueError(
            f"draft vocab size {draft_vocab_size} != target vocab size {target_vocab_size}"
            + ("" if same_tokenizer else " (pass both tokenizers if only the embedding padding differs)")
        )


class DraftModelProposer(Proposer):
    """Draft with a small HF causal LM.

    Args:
        draft_model: HF causal LM sharing the target's tokenizer.
        target_vocab_size: the target's logit size (``target.config.vocab_size``).
        num_tokens: chain length ``K`` (chain mode).
        mode: ``"chain"``, ``"tree"`` (dynamic) or ``"static"``.
        tree_depth, tree_top_k, tree_total_tokens: dynamic tree settings (EAGLE-2's depth, top-k and
            total tokens).
        tree_paths: static tree top-k paths (static mode).
        target_tokenizer, draft_tokenizer: optional, for the compatibility check.
    """

    name = "draft_model"
    needs_hidden_states = False

    def __init__(
        self,
        draft_model: torch.nn.Module,
        target_vocab_size: int,
        num_tokens: int = 4,
        mode: Literal["chain", "tree", "static"] = "chain",
        tree_depth: int = 4,
        tree_top_k: int = 4,
        tree_total_tokens: int = 16,
        tree_paths: Sequence[Sequence[int]] | None = None,
        target_tokenizer: Any | None = None,
        draft_tokenizer: Any | None = None,
    ) -> None:
        if mode not in ("chain", "tree", "static"):
            raise ValueError(f"unknown mode {mode!r}")
        if mode == "chain" and num_tokens < 1:
            raise ValueError("num_tokens must be >= 1")
        if mode == "static" and not tree_paths:
            raise ValueError("static mode needs tree_paths")
        self.draft_vocab_size = _model_vocab_size(draft_model)
        check_vocab_compatibility(target_vocab_size, self.draft_vocab_size, target_tokenizer, draft_tokenizer)
        if mode != "chain":
            impl = getattr(draft_model.config, "_attn_implementation", None)
            if impl not in TREE_ATTN_IMPLEMENTATIONS:
                raise ValueError(f"tree modes need sdpa/eager attention in the draft model, got {impl!r}")
        self.draft = draft_model
        self.target_vocab_size = int(target_vocab_size)
        self.num_tokens = int(num_tokens)
        self.mode = mode
        self.tree_depth = int(tree_depth)
        self.tree_top_k = int(tree_top_k)
        self.tree_total_tokens = int(tree_total_tokens)
        self.tree_paths = [tuple(p) for p in tree_paths] if tree_paths else None
        self.name = f"draft_model_{mode}"
        self._cache: Any = None
        self._cached: list[int] = []  # tokens whose KV are in self._cache, in order
        self.draft_forwards = 0

    # -- helpers --------------------------------------------------------------------------------

    def _device(self) -> torch.device:
        return next(self.draft.parameters()).device

    def _dtype(self) -> torch.dtype:
        return next(self.draft.parameters()).dtype

    def _adapt(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[..., V_draft]`` -> ``[..., V_target]`` float32 (cut / pad with -inf)."""
        logits = logits.float()
        v = self.target_vocab_size
        if logits.shape[-1] > v:
            return logits[..., :v]
        if logits.shape[-1] < v:
            pad = logits.new_full((*logits.shape[:-1], v - logits.shape[-1]), float("-inf"))
            return torch.cat([logits, pad], dim=-1)
        return logits

    def _forward(
        self,
        tokens: list[int],
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Feed ``tokens`` to the draft on top of its cache; returns adapted logits ``[n, V]``."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self._device())
        out = model_forward(self.draft, ids, self._cache, position_ids=position_ids, attention_mask=attention_mask)
        self.draft_forwards += 1
        return self._adapt(out.logits[0])

    def _sync(self, context: list[int]) -> torch.Tensor:
        """Make the cache hold ``context`` exactly; return the next-token logits ``[V]`` after it."""
        lcp = 0
        for a, b in zip(self._cached, context, strict=False):
            if a != b:
                break
            lcp += 1
        keep = min(lcp, len(context) - 1)  # always feed >= 1 token to get fresh logits
        crop_cache(self._cache, keep)
        logits = self._forward(context[keep:])
        self._cached = list(context)
        return logits[-1]

    # -- Proposer API ---------------------------------------------------------------------------

    def begin(self, prompt_ids: torch.Tensor, target_out: TargetOutput) -> None:
        """Reset the draft cache (the prompt is prefilled lazily at the first ``propose``)."""
        self._cache = new_cache(self.draft)
        self._cached = []

    @torch.inference_mode()
    def propose(self, context: torch.Tensor) -> DraftTree:
        """Chain or tree draft below ``context[-1]`` (see module docstring)."""
        if self._cache is None:  # propose() without begin(): start from an empty cache
            self._cache = new_cache(self.draft)
            self._cached = []
        ctx = context.reshape(-1).tolist()
        logits = self._sync(ctx)
        if self.mode == "chain":
            return self._propose_chain(ctx, logits)
        return self._propose_tree(ctx, logits)

    def _propose_chain(self, ctx: list[int], logits: torch.Tensor) -> DraftTree:
        toks: list[int] = []
        qs: list[torch.Tensor] = []
        for i in range(self.num_tokens):
            tok = self.draft_token(logits, qs)
            toks.append(tok)
            if i < self.num_tokens - 1:
                logits = self._forward([tok])[-1]
                self._cached.append(tok)
        return chain(toks, probs=torch.stack(qs) if qs else None)

    def _propose_tree(self, ctx: list[int], logits: torch.Tensor) -> DraftTree:
        ctx_len = len(ctx)
        fed: list[int] = []  # tree nodes whose KV follow the context in the cache, in cache order
        dtype, device = self._dtype(), self._device()

        def expand_fn(tokens: torch.Tensor, parents: list[int], expand: list[int]) -> torch.Tensor:
            """Run the ``expand`` nodes through the draft with tree attention; return their log-probs."""
            full = tree_attention_mask(parents)
            allowed = torch.cat(
                [torch.ones(len(expand), ctx_len, dtype=torch.bool), full[expand][:, fed + expand]], dim=1
            )
            mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
            depths = tree_depths(parents)
            pos = torch.tensor([[ctx_len - 1 + depths[i] for i in expand]], dtype=torch.long, device=device)
            out = self._forward(tokens[expand].tolist(), position_ids=pos, attention_mask=mask[None, None].to(device))
            fed.extend(expand)
            return torch.log_softmax(out, dim=-1)

        root_lp = torch.log_softmax(logits, dim=-1)
        try:
            if self.mode == "tree":
                tree = dynamic_tree(expand_fn, root_lp, self.tree_depth, self.tree_top_k, self.tree_total_tokens)
            else:
                assert self.tree_paths is not None
                tree = static_tree(self.tree_paths, expand_fn, root_lp)
        finally:
            crop_cache(self._cache, ctx_len)  # drop the tree's KV, keep the context
            self._cached = list(ctx)
        return tree
