"""Proposer for feature-level draft heads (EAGLE-1/2; EAGLE-3 through the same hooks).

The head keeps its own key/value cache over committed positions. Rows of target hidden states arrive
from the decoder (prefill, then every verification pass) and are run through the head lazily, at the next
``propose``, once the token that follows each row is known. Drafting feeds the head its own predicted
features: as a chain (``decode=chain``) or as an EAGLE-2 dynamic tree (``decode=tree``) grown with tree
attention over the committed cache plus the already-expanded ancestors. Draft keys/values are never
written into the committed cache, so nothing has to be rolled back.

Exact (lossless) with any head, trained or not: the target verifies every draft token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from eval.config import Decode
from eval.proposers.base import Proposer, TargetOutput
from eval.tree import DraftTree, chain, dynamic_tree, tree_attention_mask, tree_depths

KV = tuple[torch.Tensor, torch.Tensor]


def _cat_kv(a: list[KV], b: list[KV]) -> list[KV]:
    """Concatenate two per-layer key/value lists along the sequence dimension."""
    return [(torch.cat([x[0], y[0]], 2), torch.cat([x[1], y[1]], 2)) for x, y in zip(a, b, strict=True)]


class FeatureHeadProposer(Proposer):
    """Drafts with a head ``head(features[B,T,F], next_ids[B,T], position_ids[B,T], past, mask) -> (out, kvs)``.

    Args:
        head: the draft head (see :class:`train.drafters.eagle.EagleHead`).
        lm_head: maps head outputs ``[n, H]`` to target-vocabulary logits ``[n, V]``.
        cfg: the drafter config (``decode``, ``chain_k``, ``tree_depth``, ``tree_top_k``, ``tree_total_tokens``).
        feature_fn: maps a decoder hidden-state dict to head input features ``[n, F]`` (default: ``"last"``).
        aux_hidden_layers: intermediate target layers the head needs (EAGLE-3), else None.
    """

    needs_hidden_states = True

    def __init__(
        self,
        head: torch.nn.Module,
        lm_head: Callable[[torch.Tensor], torch.Tensor],
        cfg: Any,
        feature_fn: Callable[[dict[int | str, torch.Tensor]], torch.Tensor] | None = None,
        aux_hidden_layers: list[int] | None = None,
    ) -> None:
        self.head = head.eval()
        self.lm_head = lm_head
        self.mode = Decode.parse(cfg.decode, "drafter.decode")
        self.chain_k = int(cfg.chain_k)
        self.tree_depth = int(cfg.tree_depth)
        self.tree_top_k = int(cfg.tree_top_k)
        self.tree_total_tokens = int(cfg.tree_total_tokens)
        self.feature_fn = feature_fn or (lambda h: h["last"])
        self.aux_hidden_layers = aux_hidden_layers
        self.name = f"{getattr(cfg, 'name', 'head')}_{self.mode}"
        self._past: list[KV] | None = None
        self._n = 0
        self._pending: list[torch.Tensor] = []
        self._root_feat: torch.Tensor | None = None

    def _dtype(self) -> torch.dtype:
        return next(self.head.parameters()).dtype

    def begin(self, prompt_ids: torch.Tensor, target_out: TargetOutput) -> None:
        assert target_out.hidden_states is not None, "decoder must deliver hidden states"
        self._past, self._n, self._root_feat = None, 0, None
        self._pending = [self.feature_fn(target_out.hidden_states)]

    def commit(
        self, context: torch.Tensor, n_new: int, hidden_states_of_accepted: dict[int | str, torch.Tensor] | None
    ) -> None:
        assert hidden_states_of_accepted is not None
        self._pending.append(self.feature_fn(hidden_states_of_accepted))

    def _sync(self, context: torch.Tensor) -> torch.Tensor:
        """Run pending rows through the head; return the predicted feature at the root's position."""
        if self._pending:
            feats = torch.cat(self._pending).to(self._dtype())
            n = feats.shape[0]
            if self._n + n != context.numel() - 1:
                raise RuntimeError(f"head has {self._n}+{n} rows for a context of {context.numel()} tokens")
            ids = context[self._n + 1 : self._n + n + 1].to(feats.device)
            pos = torch.arange(self._n, self._n + n, device=feats.device)
            out, self._past = self.head(feats[None], ids[None], pos[None], past=self._past)
            self._n += n
            self._root_feat = out[0, -1]
            self._pending = []
        assert self._root_feat is not None
        return self._root_feat

    def _logits(self, feats: torch.Tensor) -> torch.Tensor:
        return self.lm_head(feats).float()

    @torch.inference_mode()
    def propose(self, context: torch.Tensor) -> DraftTree:
        root_feat = self._sync(context)
        if self.mode == "chain":
            return self._chain(root_feat)
        return self._tree(root_feat)

    def _chain(self, feat: torch.Tensor) -> DraftTree:
        past = self._past
        pos = self._n  # the root's position
        logits = self._logits(feat[None])[0]
        toks: list[int] = []
        qs: list[torch.Tensor] = []
        for i in range(self.chain_k):
            tok = self.draft_token(logits, qs)
            toks.append(tok)
            if i < self.chain_k - 1:
                ids = torch.tensor([[tok]], device=feat.device)
                out, past = self.head(feat[None, None], ids, torch.tensor([[pos]], device=feat.device), past=past)
                feat, pos = out[0, -1], pos + 1
                logits = self._logits(feat[None])[0]
        return chain(toks, probs=torch.stack(qs) if qs else None)

    def _tree(self, root_feat: torch.Tensor) -> DraftTree:
        device = root_feat.device
        committed = self._past
        P = self._n
        node_out: dict[int, torch.Tensor] = {}
        run: list[int] = []
        run_kv: list[KV] | None = None

        def expand_fn(tokens: torch.Tensor, parents: list[int], expand: list[int]) -> torch.Tensor:
            nonlocal run_kv
            depths = tree_depths(parents)
            feats = torch.stack([root_feat if parents[e] == -1 else node_out[parents[e]] for e in expand])
            ids = tokens[expand].to(device)
            pos = torch.tensor([P + depths[e] - 1 for e in expand], device=device)
            anc = tree_attention_mask(parents)[expand][:, run + expand]
            allowed = torch.cat([torch.ones(len(expand), P, dtype=torch.bool), anc], dim=1).to(device)
            past = run_kv if committed is None else (committed if run_kv is None else _cat_kv(committed, run_kv))
            out, kvs = self.head(feats[None], ids[None], pos[None], past=past, mask=allowed[None, None])
            new = [(k[:, :, -len(expand) :], v[:, :, -len(expand) :]) for k, v in kvs]
            run_kv = new if run_kv is None else _cat_kv(run_kv, new)
            run.extend(expand)
            for r, e in enumerate(expand):
                node_out[e] = out[0, r]
            return torch.log_softmax(self._logits(out[0]), dim=-1)

        root_lp = torch.log_softmax(self._logits(root_feat[None])[0], dim=-1)
        return dynamic_tree(expand_fn, root_lp, self.tree_depth, self.tree_top_k, self.tree_total_tokens)
