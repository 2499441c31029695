"""Speculative decoding with chain or tree drafts, verified in ONE target forward per step.

Exact (lossless): at temperature 0 the output equals greedy decoding of the target token for
token (up to floating-point ties); at temperature > 0 every emitted token is distributed exactly
as ancestral sampling from the target's (temperature / top-p transformed) distribution -- see
``eval.sampling`` (Leviathan et al., ICML 2023, arXiv:2211.17192; Chen et al., 2023,
arXiv:2302.01318; SpecInfer, Miao et al., ASPLOS 2024, arXiv:2305.09781 for trees).

Tree verification with transformers 5.x
---------------------------------------
The verification input is ``[root, node_0, ..., node_{N-1}]`` (root = last committed token, not
yet in the KV cache).  For a tree we pass

* ``position_ids`` = ``[[past_len, past_len + depth(node_0), ...]]`` (``LongTensor[1, N+1]``), and
* ``attention_mask`` = a 4D float tensor ``[1, 1, N+1, past_len+N+1]`` in the model dtype with 0 where
  attention is allowed and ``torch.finfo(dtype).min`` elsewhere: every query sees the whole past,
  the root sees itself, node ``i`` sees the root, itself and its ancestors
  (:func:`eval.tree.tree_attention_mask`).

``transformers.masking_utils._preprocess_mask_arguments`` returns any 4D mask unchanged ("already
prepared, or custom"), and the attention functions then use it as is: ``sdpa`` passes it as
``attn_mask`` to ``torch.nn.functional.scaled_dot_product_attention`` (additive float masks are
supported) and ``eager`` adds it to the attention scores.  An additive float mask therefore works
for both, whereas a boolean mask would only work for ``sdpa``.  ``flash_attention_*`` cannot take a
custom mask and ``flex_attention`` needs a BlockMask, so tree drafts require ``sdpa`` or ``eager``
(chains use the model's own causal mask and work with any implementation).

KV rollback
-----------
The target cache must only hold committed tokens.  After a chain step it is cropped to
``past_len + 1 + n_accepted``; after a tree step the root's and the accepted path's entries are
gathered (``index_select`` along the sequence dim of every layer's keys / values) and the rest
dropped.  Only full-attention ``DynamicLayer`` caches are supported (sliding-window or linear
attention layers cannot be rolled back this way and raise ``NotImplementedError``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from data.modeling import cache_keep_positions, cache_seq_len, crop_cache, kv_layers, model_forward, new_cache
from eval.metrics import DecodeStats
from eval.proposers.base import Proposer, TargetOutput
from eval.sampling import logits_to_probs, sample_from_probs, verify_tree
from eval.tree import TREE_ATTN_IMPLEMENTATIONS, DraftTree, tree_attention_mask, tree_position_ids

logger = logging.getLogger(__name__)

__all__ = [
    "DecodeResult",
    "DecodeState",
    "SpeculativeDecoder",
    "build_verification_mask",
    "cache_keep_positions",
    "cache_seq_len",
    "crop_cache",
    "model_forward",
    "plain_decode",
]


# ----------------------------------------------------------------------------------------------
# transformers plumbing
# ----------------------------------------------------------------------------------------------


def build_verification_mask(
    parents: Sequence[int], past_len: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Additive 4D mask for verifying ``[root] + tree`` on top of ``past_len`` cached tokens.

    Returns:
        ``[1, 1, N+1, past_len+N+1]`` tensor of ``dtype``: 0 = attend, ``finfo(dtype).min`` = masked.
    """
    n = len(parents)
    allowed = torch.zeros(n + 1, past_len + n + 1, dtype=torch.bool)
    allowed[:, : past_len + 1] = True  # past + root, for everyone
    allowed[1:, past_len + 1 :] = tree_attention_mask(parents)
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None].to(device)


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _eos_set(eos_token_id: int | Sequence[int] | None) -> set[int]:
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(e) for e in eos_token_id}


def _hidden_dict(out: Any, rows: torch.Tensor | slice, layers: Sequence[int] | None) -> dict[int | str, torch.Tensor]:
    hs = out.hidden_states
    d: dict[int | str, torch.Tensor] = {"last": hs[-1][0, rows]}
    for layer in layers or []:
        d[int(layer)] = hs[layer][0, rows]
    return d


# ----------------------------------------------------------------------------------------------
# decoder
# ----------------------------------------------------------------------------------------------


@dataclass
class DecodeResult:
    """Output of a generation: the new tokens only (prompt excluded) and the statistics."""

    tokens: list[int]
    stats: DecodeStats


@dataclass
class DecodeState:
    """Mutable state of one speculative generation (batch size 1).

    Invariant between steps: ``cache`` holds exactly ``context[:-1]``; ``context[-1]`` is the root
    of the next draft.
    """

    cache: Any
    context: torch.Tensor  # LongTensor[T'] prompt + committed new tokens (on the target's device)
    prompt_len: int
    max_new_tokens: int
    eos: set[int]
    generator: torch.Generator | None
    stats: DecodeStats = field(default_factory=DecodeStats)
    finished: bool = False
    t_start: float = 0.0

    @property
    def new_tokens(self) -> list[int]:
        """Generated tokens so far."""
        return self.context[self.prompt_len :].tolist()


class SpeculativeDecoder:
    """Lossless speculative decoding of a HF causal LM with a pluggable :class:`Proposer`.

    Args:
        target: HF causal LM (``sdpa`` or ``eager`` attention for tree drafts).
        proposer: the drafter.
        temperature: 0 = greedy, else sampling at this temperature (shared with the proposer).
        top_p: nucleus filter applied identically to target and draft distributions.
    """

    def __init__(self, target: torch.nn.Module, proposer: Proposer, temperature: float = 0.0, top_p: float = 1.0):
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"bad sampling settings temperature={temperature} top_p={top_p}")
        self.target = target
        self.proposer = proposer
        self.temperature = float(temperature)
        self.top_p = float(top_p)

    @property
    def greedy(self) -> bool:
        """Temperature-0 decoding."""
        return self.temperature == 0.0

    # -- public API -----------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        eos_token_id: int | list[int] | None = None,
        generator: torch.Generator | None = None,
    ) -> DecodeResult:
        """Generate up to ``max_new_tokens`` tokens after ``input_ids`` (``LongTensor[1, T]``).

        Stops right after the first eos token (included in the output).  ``generator`` (a CPU
        ``torch.Generator``, whatever the model's device) is required at temperature > 0 -- no global
        RNG is used; the proposer draws from the same generator.

        Returns:
            :class:`DecodeResult` with the new tokens and :class:`DecodeStats`.
        """
        state = self.start(input_ids, max_new_tokens, eos_token_id, generator)
        while not state.finished:
            self.step(state)
        return DecodeResult(tokens=state.new_tokens, stats=state.stats)

    @torch.inference_mode()
    def start(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        eos_token_id: int | list[int] | None = None,
        generator: torch.Generator | None = None,
    ) -> DecodeState:
        """Prefill the target, emit the first token from the prefill logits, start the proposer."""
        if input_ids.ndim != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be [1, T], got {tuple(input_ids.shape)}")
        if not self.greedy and generator is None:
            raise ValueError("temperature > 0 requires an explicit torch.Generator")
        t_start = time.perf_counter()
        device = _model_device(self.target)
        prompt = input_ids[0].to(device)
        state = DecodeState(
            cache=new_cache(self.target),
            context=prompt.clone(),
            prompt_len=int(prompt.numel()),
            max_new_tokens=int(max_new_tokens),
            eos=_eos_set(eos_token_id),
            generator=generator,
            t_start=t_start,
        )
        state.stats.n_sequences = 1
        if max_new_tokens <= 0:
            state.finished = True
            return state
        want_hidden = self.proposer.needs_hidden_states
        t0 = time.perf_counter()
        out = model_forward(self.target, prompt[None], state.cache, output_hidden_states=want_hidden)
        logits = out.logits[0].float()
        first = self._sample_one(logits[-1], generator)
        state.stats.target_time_s += time.perf_counter() - t0
        state.stats.target_forwards += 1
        state.stats.prefill_forwards += 1
        kv_layers(state.cache)  # fail early on caches that cannot be rolled back

        self.proposer.setup(self.temperature, self.top_p, generator)
        hidden = _hidden_dict(out, slice(None), self.proposer.aux_hidden_layers) if want_hidden else None
        t0 = time.perf_counter()
        self.proposer.begin(prompt, TargetOutput(logits=logits, hidden_states=hidden))
        state.stats.draft_time_s += time.perf_counter() - t0
        self._append(state, [first])
        return state

    @torch.inference_mode()
    def step(self, state: DecodeState) -> list[int]:
        """One draft -> verify -> accept -> rollback step.  Returns the tokens emitted this step."""
        if state.finished:
            return []
        stats = state.stats
        remaining = state.max_new_tokens - (int(state.context.numel()) - state.prompt_len)

        t0 = time.perf_counter()
        tree = self.proposer.propose(state.context)
        stats.draft_time_s += time.perf_counter() - t0
        # never verify tokens that could not be emitted (HF assisted generation does the same)
        tree = tree.truncate_depth(remaining - 1)

        t0 = time.perf_counter()
        accepted, next_token, out, keep = self._verify(state, tree)
        cache_keep_positions(state.cache, int(state.context.numel()) - 1, keep)
        stats.target_time_s += time.perf_counter() - t0
        stats.target_forwards += 1

        last = accepted[-1] if accepted else -1
        has_child = any(p == last for p in tree.parents)
        stats.record_step(len(accepted), len(accepted) + int(has_child), len(tree))

        tokens = tree.tokens.tolist()
        emitted = [tokens[i] for i in accepted] + [next_token]
        emitted = self._append(state, emitted)
        if not state.finished:
            hidden = None
            if self.proposer.needs_hidden_states:
                rows = torch.tensor(keep, dtype=torch.long, device=out.logits.device)
                hidden = _hidden_dict(out, rows, self.proposer.aux_hidden_layers)
            t0 = time.perf_counter()
            self.proposer.commit(state.context, len(emitted), hidden)
            stats.draft_time_s += time.perf_counter() - t0
        return emitted

    # -- internals ------------------------------------------------------------------------------

    def _sample_one(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        if self.greedy:
            return int(logits.argmax())
        return sample_from_probs(logits_to_probs(logits, self.temperature, self.top_p), generator)

    def _verify(self, state: DecodeState, tree: DraftTree) -> tuple[list[int], int, Any, list[int]]:
        """Run ``[root] + tree`` through the target once and verify; returns accepted, next, out, keep."""
        past_len = int(state.context.numel()) - 1
        if cache_seq_len(state.cache) != past_len:
            raise RuntimeError(f"cache holds {cache_seq_len(state.cache)} tokens, expected {past_len}")
        device = state.context.device
        input_ids = torch.cat([state.context[-1:], tree.tokens.to(device)])[None]
        positions = torch.cat([torch.tensor([past_len]), tree_position_ids(tree.parents, past_len)])[None].to(device)
        mask = None
        if not tree.is_chain():
            impl = getattr(self.target.config, "_attn_implementation", None)
            if impl not in TREE_ATTN_IMPLEMENTATIONS:
                raise ValueError(
                    f"tree drafts need a custom 4D attention mask, supported with attn_implementation in "
                    f"{TREE_ATTN_IMPLEMENTATIONS}; the target uses {impl!r}"
                )
            mask = build_verification_mask(tree.parents, past_len, _model_dtype(self.target), device)
        out = model_forward(
            self.target,
            input_ids,
            state.cache,
            position_ids=positions,
            attention_mask=mask,
            output_hidden_states=self.proposer.needs_hidden_states,
        )
        logits = out.logits[0].float()
        if self.greedy:
            accepted, next_token = verify_tree(tree, logits, greedy=True)
        else:
            probs = logits_to_probs(logits, self.temperature, self.top_p)
            accepted, next_token = verify_tree(tree, probs, state.generator, greedy=False)
        keep = [0] + [i + 1 for i in accepted]
        return accepted, next_token, out, keep

    def _append(self, state: DecodeState, tokens: list[int]) -> list[int]:
        """Append ``tokens`` to the context, truncated at eos / max_new_tokens; update stats."""
        out: list[int] = []
        n_new = int(state.context.numel()) - state.prompt_len
        for t in tokens:
            if n_new + len(out) >= state.max_new_tokens:
                break
            out.append(int(t))
            if int(t) in state.eos:
                state.finished = True
                break
        if out:
            add = torch.tensor(out, dtype=state.context.dtype, device=state.context.device)
            state.context = torch.cat([state.context, add])
        state.stats.new_tokens += len(out)
        if int(state.context.numel()) - state.prompt_len >= state.max_new_tokens:
            state.finished = True
        state.stats.total_time_s = time.perf_counter() - state.t_start
        return out


@torch.inference_mode()
def plain_decode(
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> DecodeResult:
    """Autoregressive baseline: one target forward per token, KV cache, same sampling functions.

    Uses exactly the random stream a :class:`SpeculativeDecoder` uses for its first token, so the
    first token of both agree for the same seed.  Each decoding forward is recorded as a
    verification step with 0 drafts (tau = 1).

    Args:
        input_ids: ``LongTensor[1, T]``.

    Returns:
        :class:`DecodeResult`.
    """
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, T], got {tuple(input_ids.shape)}")
    if temperature > 0 and generator is None:
        raise ValueError("temperature > 0 requires an explicit torch.Generator")
    eos = _eos_set(eos_token_id)
    stats = DecodeStats(n_sequences=1)
    t_start = time.perf_counter()
    device = _model_device(target)
    cache = new_cache(target)
    tokens: list[int] = []
    next_input = input_ids.to(device)
    while len(tokens) < max_new_tokens:
        t0 = time.perf_counter()
        out = model_forward(target, next_input, cache)
        logits = out.logits[0, -1].float()
        if temperature == 0:
            tok = int(logits.argmax())
        else:
            tok = sample_from_probs(logits_to_probs(logits, temperature, top_p), generator)
        stats.target_time_s += time.perf_counter() - t0
        stats.target_forwards += 1
        if not tokens:
            stats.prefill_forwards += 1
        else:
            stats.record_step(0, 0, 0)
        tokens.append(tok)
        if tok in eos:
            break
        next_input = torch.tensor([[tok]], dtype=torch.long, device=device)
    stats.new_tokens = len(tokens)
    stats.total_time_s = time.perf_counter() - t_start
    return DecodeResult(tokens=tokens, stats=stats)
