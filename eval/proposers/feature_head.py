"""Proposer for feature-level draft heads (EAGLE-1/2; EAGLE-3 through the same hooks).

The head keeps its own key/value cache over committed positions. Rows of target hidden states arrive
from the decoder (prefill, then every verification pass) and are run through the head lazily, at the next
``propose``, once the token that follows each row is known. Drafting feeds the head its own predicted
features: as a chain (``decode=chain``) or as an EAGLE-2 dynamic tree (``decode=tree``) grown with tree
attention over the committed cache plus the already-expanded ancestors. Draft keys/values are never
written into the committed cache, so nothing has to be rolled back.

Exact (lossless) with any head, trained or not: the target verifies every draft token.

Replay (:mod:`eval.replay`) can draft for many prompts at once through :meth:`FeatureHeadProposer.replayer`
(:class:`FeatureHeadReplayer`): each prompt's committed rows are run through the head once, teacher-forced over
its whole traced sequence, and every drafting call then serves all waiting prompts in one batch, each row
attending to its own prefix (:class:`eval.shared_past.SharedPast`); the chain and the tree (the same
:func:`eval.tree.dynamic_tree_steps`) are grown exactly as above.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch

from eval.config import Decode
from eval.proposers.base import Proposer, TargetOutput
from eval.sampling import logits_to_probs
from eval.shared_past import SharedPast
from eval.tree import (
    DraftTree,
    TreeRequest,
    chain,
    dynamic_tree,
    dynamic_tree_steps,
    rank_rows,
    tree_attention_mask,
    tree_depths,
)

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
        draft_vocab: for a head with a reduced draft vocabulary (EAGLE-3): ``(draft_lm_head, target_ids)``, the
            logits over the draft vocabulary ``[n, Vd]`` and the target id of each entry ``[Vd]``; ``lm_head`` is
            then these logits placed in the target vocabulary (``-inf`` elsewhere). Replay drafts in the draft
            vocabulary when the ids are increasing (the same argmax and ranking, ties included, at a sixth of the
            width); the decoder always uses ``lm_head``.
    """

    needs_hidden_states = True

    def __init__(
        self,
        head: torch.nn.Module,
        lm_head: Callable[[torch.Tensor], torch.Tensor],
        cfg: Any,
        feature_fn: Callable[[dict[int | str, torch.Tensor]], torch.Tensor] | None = None,
        aux_hidden_layers: list[int] | None = None,
        draft_vocab: tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.head = head.eval()
        self.lm_head = lm_head
        self.draft_vocab = draft_vocab
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

    def replayer(self, slots: int, max_len: int) -> FeatureHeadReplayer:
        """A batched drafter for greedy replay (see :class:`FeatureHeadReplayer`)."""
        return FeatureHeadReplayer(self, slots, max_len)


class FeatureHeadReplayer:
    """Greedy drafting from many replayed prefixes at once (:func:`eval.replay.replay_many`).

    A prompt is admitted into a slot with its whole traced sequence (prompt + continuation) and the target's hidden
    states of it; the head runs over all of its rows once (teacher-forced: the same rows the decoder feeds it one
    commit at a time), and the keys/values and outputs are kept in the slot. :meth:`propose` then drafts, for any
    set of ``(slot, context length)``, what :meth:`FeatureHeadProposer.propose` would draft after that context:
    one head call per chain position or tree depth for all of them, each row attending to its own committed
    prefix and its own draft ancestors. Only floating-point summation order differs from the one-prompt path.

    Args:
        prop: the proposer whose head, LM head, feature function and decode settings are used.
        slots: how many prompts can be admitted at once.
        max_len: the longest traced sequence (prompt + continuation tokens) any slot will hold.
    """

    def __init__(self, prop: FeatureHeadProposer, slots: int, max_len: int) -> None:
        self.p = prop
        self.chain = prop.mode == "chain" and not prop.greedy_drafts  # a chain it samples at temperature > 0
        self.slots = int(slots)
        self.max_len = int(max_len)
        self._seq: list[torch.Tensor | None] = [None] * self.slots
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._out: list[torch.Tensor | None] = [None] * self.slots
        # logits over the draft vocabulary where the head has one and its target ids are increasing (then argmax
        # and the stable ranking pick the same tokens as over the -inf-padded target vocabulary)
        self._ids: torch.Tensor | None = None
        self._ids_list: list[int] | None = None
        self._logits = prop._logits
        if prop.draft_vocab is not None:
            draft_lm_head, ids = prop.draft_vocab
            if ids.numel() < 2 or bool((ids[1:] > ids[:-1]).all()):
                self._ids, self._ids_list = ids, ids.tolist()
                self._logits = lambda x: draft_lm_head(x).float()
        self._draft_index: torch.Tensor | None = None  # target id -> draft-vocabulary index (-1: not drafted)

    def _argmax(self, feat: torch.Tensor) -> torch.Tensor:
        """The greedy token after each row of ``feat`` ``[n, H]``, a target id."""
        t = self._logits(feat).argmax(-1)
        return t if self._ids is None else self._ids[t]

    def _rank(self, feat: torch.Tensor) -> tuple[list[list[float]], list[list[int]]]:
        """:func:`eval.tree.rank_rows` of the log-probs after each row of ``feat``, ids in the target vocabulary."""
        vals, idx = rank_rows(torch.log_softmax(self._logits(feat), dim=-1), self.p.tree_top_k)
        if self._ids_list is not None:
            ids = self._ids_list
            idx = [[ids[t] for t in row] for row in idx]
        return vals, idx

    @torch.inference_mode()
    def admit(self, slot: int, seq: torch.Tensor, hidden: dict[int | str, torch.Tensor]) -> None:
        """Run the head over every row of ``hidden`` (``[M, ...]``, the target's states of ``seq[:M]``) into
        ``slot``; ``seq`` holds at least ``M + 1`` tokens."""
        p = self.p
        feats = p.feature_fn(hidden).to(p._dtype())
        M = feats.shape[0]
        if seq.numel() <= M or self.max_len < M:
            raise ValueError(f"slot {slot}: {M} rows for {seq.numel()} tokens (capacity {self.max_len})")
        ids = seq[1 : M + 1].to(feats.device)
        pos = torch.arange(M, device=feats.device)
        out, kvs = p.head(feats[None], ids[None], pos[None])
        if not self._k:
            for k, v in kvs:
                shape = (self.slots, k.shape[1], self.max_len, k.shape[3])
                self._k.append(torch.zeros(shape, dtype=k.dtype, device=k.device))
                self._v.append(torch.zeros(shape, dtype=v.dtype, device=v.device))
        for layer, (k, v) in enumerate(kvs):
            self._k[layer][slot, :, :M] = k[0]
            self._v[layer][slot, :, :M] = v[0]
        self._out[slot] = out[0]
        self._seq[slot] = seq

    def release(self, slot: int) -> None:
        self._out[slot] = None
        self._seq[slot] = None

    @torch.inference_mode()
    def propose(self, items: Sequence[tuple[int, int]]) -> list[DraftTree]:
        """The draft after each ``(slot, L)``: the slot's prompt with ``L`` tokens of context (prompt + emitted)."""
        if not items:
            return []
        root, ks, vs, visible, Lt = self._prepare(items)
        if self.p.mode == "chain":
            return self._chain(root, ks, vs, visible, Lt)
        return self._tree(root, ks, vs, visible, Lt)

    @torch.inference_mode()
    def path_q(self, items: Sequence[tuple[int, int]], temperature: float, top_p: float) -> list[list[float]]:
        """Sampled replay of a chain (:class:`~eval.proposers.base.Replayer`): for each ``(slot, L)``, the head's
        probability of the traced tokens ``seq[L + j]`` at chain position ``j``, feeding it those tokens (what
        :meth:`FeatureHeadProposer._chain` computes with ``forced_tokens``), ``chain_k`` values (positions past the
        traced sequence: 0)."""
        if not items:
            return []
        root, ks, vs, visible, Lt = self._prepare(items)
        p, A, K = self.p, root.shape[0], self.p.chain_k
        device = root.device
        ys = torch.zeros(A, K, dtype=torch.long, device=device)
        real = torch.zeros(A, K, dtype=torch.bool, device=device)
        for a, (slot, L) in enumerate(items):
            seq = self._seq[slot]
            assert seq is not None
            tail = seq[L : L + K].to(device)
            ys[a, : tail.numel()] = tail
            real[a, : tail.numel()] = True
        feat = root
        qs = [self._prob(feat, ys[:, 0], temperature, top_p)]
        pk: list[torch.Tensor] | None = None
        pv: list[torch.Tensor] | None = None
        for i in range(1, K):
            mask = torch.ones(A, 1, 1, i, dtype=torch.bool, device=device)
            pos = (Lt - 1 + i - 1)[:, None]
            out, kvs = p.head(feat[:, None], ys[:, i - 1 : i], pos, past=self._past(ks, vs, visible, pk, pv, mask))
            pk, pv = [k for k, _ in kvs], [v for _, v in kvs]
            feat = out[:, 0]
            qs.append(self._prob(feat, ys[:, i], temperature, top_p))
        return (torch.stack(qs, dim=1) * real).tolist()

    def _prob(self, feat: torch.Tensor, ys: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
        """``[n]``: the probability of target token ``ys[r]`` after row ``r`` of ``feat`` at ``temperature`` /
        ``top_p`` (over the draft vocabulary where it drafts in it: the same distribution, 0 off it)."""
        probs = logits_to_probs(self._logits(feat), temperature, top_p)
        if self._ids is None:
            return probs.gather(-1, ys[:, None])[:, 0]
        if self._draft_index is None:
            self._draft_index = torch.full((int(self._ids.max()) + 1,), -1, dtype=torch.long, device=self._ids.device)
            self._draft_index[self._ids] = torch.arange(self._ids.numel(), device=self._ids.device)
        n = self._draft_index.numel()
        idx = torch.where(ys < n, self._draft_index[ys.clamp_max(n - 1)], -1)  # ids past the table: not drafted
        return probs.gather(-1, idx.clamp_min(0)[:, None])[:, 0] * (idx >= 0)

    def _prepare(
        self, items: Sequence[tuple[int, int]]
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """The root features, the slots' committed keys / values, their visibility mask and the context lengths."""
        slots = [s for s, _ in items]
        lens = [int(n) for _, n in items]
        outs = [self._out[s] for s in slots]
        if any(o is None for o in outs):
            raise RuntimeError(f"propose on an empty slot ({slots})")
        root = torch.stack([o[n - 2] for o, n in zip(outs, lens, strict=True)])  # type: ignore[index]
        S = max(lens) - 1  # committed rows: positions 0 .. L-2
        idx = torch.tensor(slots, device=root.device)
        if slots == list(range(len(slots))):
            ks = [k[: len(slots), :, :S] for k in self._k]
            vs = [v[: len(slots), :, :S] for v in self._v]
        else:
            ks = [k.index_select(0, idx)[:, :, :S] for k in self._k]
            vs = [v.index_select(0, idx)[:, :, :S] for v in self._v]
        Lt = torch.tensor(lens, device=root.device)
        visible = (torch.arange(S, device=root.device)[None] < (Lt - 1)[:, None])[:, None, None]
        return root, ks, vs, visible, Lt

    def _past(
        self,
        ks: list[torch.Tensor],
        vs: list[torch.Tensor],
        visible: torch.Tensor,
        pk: list[torch.Tensor] | None,
        pv: list[torch.Tensor] | None,
        mask: torch.Tensor,
    ) -> list[SharedPast]:
        return [
            SharedPast(k, v, visible, None if pk is None else pk[i], None if pv is None else pv[i], mask)
            for i, (k, v) in enumerate(zip(ks, vs, strict=True))
        ]

    def _chain(
        self, feat: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], visible: torch.Tensor, L: torch.Tensor
    ) -> list[DraftTree]:
        p, A, K = self.p, feat.shape[0], self.p.chain_k
        toks = [self._argmax(feat)]
        pk: list[torch.Tensor] | None = None
        pv: list[torch.Tensor] | None = None
        for i in range(1, K):
            mask = torch.ones(A, 1, 1, i, dtype=torch.bool, device=feat.device)
            pos = (L - 1 + i - 1)[:, None]
            out, kvs = p.head(feat[:, None], toks[-1][:, None], pos, past=self._past(ks, vs, visible, pk, pv, mask))
            pk, pv = [k for k, _ in kvs], [v for _, v in kvs]
            feat = out[:, 0]
            toks.append(self._argmax(feat))
        return [chain(r) for r in torch.stack(toks, dim=1).tolist()]

    def _tree(
        self, root: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], visible: torch.Tensor, L: torch.Tensor
    ) -> list[DraftTree]:
        p, device = self.p, root.device
        A, H = root.shape
        top_k = p.tree_top_k
        # rank every row of a depth in one call (rank_rows), then hand each tree its share
        r_vals, r_idx = self._rank(root)
        gens: list[Generator[TreeRequest, Any, DraftTree]] = []
        reqs: list[TreeRequest | None] = []
        trees: list[DraftTree | None] = [None] * A
        for a in range(A):
            g = dynamic_tree_steps(([r_vals[a]], [r_idx[a]]), p.tree_depth, top_k, p.tree_total_tokens)
            gens.append(g)
            try:
                reqs.append(next(g))
            except StopIteration as done:
                reqs.append(None)
                trees[a] = done.value
        node_out: list[dict[int, torch.Tensor]] = [{} for _ in range(A)]
        anc: list[list[set[int]]] = [[] for _ in range(A)]  # per tree: each node's ancestors and itself
        depth: list[list[int]] = [[] for _ in range(A)]
        run: list[list[int]] = [[] for _ in range(A)]  # nodes whose keys are in own_k / own_v, in that order
        own_k: list[list[torch.Tensor]] = [[] for _ in range(A)]  # per tree, per layer: [n_kv, len(run), d]
        own_v: list[list[torch.Tensor]] = [[] for _ in range(A)]
        n_layers = len(ks)
        zero = root.new_zeros(H)
        while True:
            pending = {a: r for a, r in enumerate(reqs) if r is not None}
            live = list(pending)
            if not live:
                break
            W = max(len(pending[a][2]) for a in live)
            Pm = max(len(run[a]) for a in live)
            feats: list[torch.Tensor] = []
            ids: list[list[int]] = []
            pos: list[list[int]] = []
            mask: list[list[list[bool]]] = []
            for a in live:
                tokens, parents, expand = pending[a]
                for i in range(len(anc[a]), len(parents)):  # nodes created since the last depth
                    par = parents[i]
                    anc[a].append({i} if par == -1 else anc[a][par] | {i})
                    depth[a].append(1 if par == -1 else depth[a][par] + 1)
                P = int(L[a]) - 1
                toks = tokens.tolist()
                m: list[list[bool]] = []
                for e in expand:
                    feats.append(root[a] if parents[e] == -1 else node_out[a][parents[e]])
                    own = anc[a][e]
                    m.append(
                        [j in own for j in run[a]]
                        + [False] * (Pm - len(run[a]))
                        + [c in own for c in expand]
                        + [False] * (W - len(expand))
                    )
                ids.append([toks[e] for e in expand] + [0] * (W - len(expand)))
                pos.append([P + depth[a][e] - 1 for e in expand] + [P] * (W - len(expand)))
                for r in range(len(expand), W):  # padding rows attend to themselves only
                    feats.append(zero)
                    m.append([False] * (Pm + W))
                    m[-1][Pm + r] = True
                mask.append(m)
            B = len(live)
            x = torch.stack(feats).view(B, W, H)
            mask_t = torch.tensor(mask, dtype=torch.bool, device=device)[:, None]
            pk: list[torch.Tensor] | None
            pv: list[torch.Tensor] | None
            if Pm:
                pk = [torch.stack([_pad_to(own_k[a][i], Pm) for a in live]) for i in range(n_layers)]
                pv = [torch.stack([_pad_to(own_v[a][i], Pm) for a in live]) for i in range(n_layers)]
            else:
                pk = pv = None
            past = self._past(self._sel(ks, live), self._sel(vs, live), visible[live], pk, pv, mask_t)
            out, kvs = p.head(x, torch.tensor(ids, device=device), torch.tensor(pos, device=device), past=past)
            counts = [len(pending[a][2]) for a in live]
            real = out[:, :W].reshape(B * W, H)
            keep = [b * W + r for b, c in enumerate(counts) for r in range(c)]
            vals, idx = self._rank(real[keep] if len(keep) < B * W else real)
            at = 0
            for b, a in enumerate(live):
                _, _, expand = pending[a]
                n_new, n_old = len(expand), len(run[a])
                for r, e in enumerate(expand):
                    node_out[a][e] = out[b, r]
                for i in range(n_layers):
                    k_new, v_new = kvs[i][0][b, :, Pm : Pm + n_new], kvs[i][1][b, :, Pm : Pm + n_new]
                    if n_old:
                        k_new = torch.cat([own_k[a][i], k_new], 1)
                        v_new = torch.cat([own_v[a][i], v_new], 1)
                    if len(own_k[a]) <= i:
                        own_k[a].append(k_new)
                        own_v[a].append(v_new)
                    else:
                        own_k[a][i], own_v[a][i] = k_new, v_new
                run[a].extend(expand)
                try:
                    reqs[a] = gens[a].send((vals[at : at + n_new], idx[at : at + n_new]))
                except StopIteration as done:
                    reqs[a] = None
                    trees[a] = done.value
                at += n_new
        done_trees = [t for t in trees if t is not None]
        if len(done_trees) != A:
            raise RuntimeError(f"{A - len(done_trees)} draft trees were not finished")
        return done_trees

    @staticmethod
    def _sel(ts: list[torch.Tensor], live: list[int]) -> list[torch.Tensor]:
        if live == list(range(ts[0].shape[0])):
            return ts
        idx = torch.tensor(live, device=ts[0].device)
        return [t.index_select(0, idx) for t in ts]


def _pad_to(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` ``[n_kv, m, d]`` padded with zeros to ``[n_kv, n, d]`` (padding keys are masked out)."""
    return t if t.shape[1] == n else torch.nn.functional.pad(t, (0, 0, 0, n - t.shape[1]))
