"""Continuous batching for the HF target: stage synth's generation engine and replay's continuations.

``model.generate`` on a left-padded batch (what stage synth used before) wastes work three ways on a CPU: every
prompt is prefilled at the width of the longest one in its batch (length-sorted batches of 16 were still 41%
padding), rows that end early keep occupying the batch until the longest one ends, and the batch is only as
large as its padding cost allows. This engine instead

* prefills prompts at their own length, several together only where their lengths are within 15% of each
  other (prefill is compute-bound: batching it saves little, padding it costs everything it pads);
* decodes up to ``batch_size`` rows together, one token per row per step, with one key/value cache whose rows
  are right-aligned to a common width (masked columns cost attention only, not the MLP), held in buffers
  allocated once per change of rows, so that a step writes only its new column (no copy of the cache per step);
* drops a row as soon as it ends (end-of-sequence or its token budget) and admits the next prompt into the
  free slot in place (continuous batching; the buffers keep room for the longest queued prompt, so that only a
  compaction, every ``DECODE_HEADROOM`` steps, copies the cache), trimming columns that no row uses any more.
* multiplies by weights packed once for oneDNN (:mod:`data.prepack`) where the target is float32 on a CPU,
  instead of letting every product repack them.
* computes the keys and values of the prefix that prompts prefilled together share (a chat template's system
  header: 24 of the quickstart's ~105 prompt tokens) once, not once per prompt, and remembers it for later groups;
* takes further prompts from a feed while it decodes (``more``): stage synth streams all its chunks, and each
  conversation's next turn, through one engine, so no batch drains to a tail of a few rows between chunks.

Greedy outputs equal batch-1 greedy decoding token for token (tests); each row's computation is its own (masks
and explicit positions), only the rounding of batched (and prepacked) matrix products could in principle differ.
Sampling draws every slot's token (free ones too) from one ``torch.Generator`` in slot order, so a run is
reproducible for the same prompts, batch size and seed; with per-prompt ``seeds`` each row draws from its own
generator instead, so its tokens do not depend on the rows it shares steps with (what stage synth uses).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from data.modeling import logits_to_probs, model_forward, new_cache, sliding_window
from data.prepack import prepacked_linears

logger = logging.getLogger(__name__)

__all__ = ["GenerationStats", "continuous_generate"]


@dataclass
class GenerationStats:
    """What one :func:`continuous_generate` call did (tokens, forwards, time)."""

    prompts: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_slots: int = 0
    """Rows decoded x decode steps: generated tokens / decode slots is the batch's occupancy."""
    idle_slots: int = 0
    """Free slots carried through decode steps (at the tail, until the cache is compacted)."""
    cache_rebuilds: int = 0
    """Times the cache buffers were rebuilt (first fill, compaction)."""
    admitted_in_place: int = 0
    """Rows admitted into a free slot without rebuilding the cache."""
    prefix_tokens_reused: int = 0
    """Prompt tokens whose keys and values came from a shared prefix instead of their own prefill."""
    prefix_forwards: int = 0
    """Batch-1 forwards that computed a shared prefix (once each, then reused)."""
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds


def _layers(cache: Any) -> list[Any]:
    layers = getattr(cache, "layers", None)
    if layers is None or any(not hasattr(layer, "keys") for layer in layers):
        raise NotImplementedError(f"continuous batching needs a DynamicCache with .layers (got {type(cache).__name__})")
    return list(layers)


def _kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in _layers(cache)]


def _pick(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """Next token of every row of ``logits`` ``[B, V]``: argmax, or a sample at ``temperature`` / ``top_p``."""
    if temperature <= 0.0:
        return logits.argmax(-1)
    probs = torch.stack([logits_to_probs(row, temperature, top_p) for row in logits])
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class _SlotLayer(DynamicLayer):
    """One layer's cached keys/values as views of preallocated buffers ``[B, h, cap, d]``.

    Columns ``[start, end)`` are cached; :meth:`update` writes the step's new columns at ``end`` in place and
    returns views, so a decode step copies nothing but its own new column. (A ``DynamicCache`` built from tensors
    copies the whole cache twice per step -- once when built, once by ``torch.cat`` in ``update`` -- which at 32
    rows x 300 columns cost more than the model's own forward on this CPU.)
    """

    def __init__(self, kbuf: torch.Tensor, vbuf: torch.Tensor, start: int, end: int) -> None:
        super().__init__()
        self.kbuf, self.vbuf, self.start, self.end = kbuf, vbuf, start, end
        self.device = kbuf.device
        self.keys, self.values = kbuf[:, :, start:end], vbuf[:, :, start:end]
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = key_states.shape[-2]
        if self.end + n > self.kbuf.shape[2]:
            raise RuntimeError("slot cache overflow (the engine must compact before a step)")
        self.kbuf[:, :, self.end : self.end + n].copy_(key_states)
        self.vbuf[:, :, self.end : self.end + n].copy_(value_states)
        self.end += n
        self.keys = self.kbuf[:, :, self.start : self.end]
        self.values = self.vbuf[:, :, self.start : self.end]
        return self.keys, self.values


def slot_cache(model: torch.nn.Module, bufs: list[tuple[torch.Tensor, torch.Tensor]], start: int, end: int) -> Any:
    cache = new_cache(model)
    cache.layers = [_SlotLayer(k, v, start, end) for k, v in bufs]
    return cache


DECODE_HEADROOM = 64
"""Free columns allocated past the widest row at each rebuild of the cache: a compaction at most this often."""
PREFILL_PAD_TOLERANCE = 0.15
"""Prompts are prefilled together only while padding them to the longest adds at most this share of tokens."""
PREFILL_TOKENS = 4096
"""Most (padded) prompt tokens in one prefill forward."""


def _prefill_groups(lengths: Sequence[int]) -> list[int]:
    """Sizes of consecutive groups of ``lengths`` (in admission order) to prefill together: neighbours of similar
    length (padding <= :data:`PREFILL_PAD_TOLERANCE` of the group's tokens, <= :data:`PREFILL_TOKENS` in all)."""
    sizes: list[int] = []
    i = 0
    while i < len(lengths):
        n, total, longest = 1, lengths[i], lengths[i]
        while i + n < len(lengths):
            m = max(longest, lengths[i + n])
            t = total + lengths[i + n]
            if m * (n + 1) > PREFILL_TOKENS or m * (n + 1) > (1 + PREFILL_PAD_TOLERANCE) * t:
                break
            n, total, longest = n + 1, t, m
        sizes.append(n)
        i += n
    return sizes


SHARED_PREFIX_MIN = 8
"""Prompts prefilled together reuse the keys and values of their common prefix (computed once) when it is at
least this many tokens long (e.g. a chat template's default system header: 24 of the quickstart's ~105 tokens)."""
SHARED_PREFIX_MEMO = 8
"""Shared prefixes kept per :func:`continuous_generate` call (most recently used first)."""


def _common_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix common to every prompt."""
    first = prompts[0]
    n = min(len(p) for p in prompts)
    for p in prompts[1:]:
        i = 0
        while i < n and p[i] == first[i]:
            i += 1
        n = i
    return n


class _PrefixMemo:
    """Keys and values of shared prompt prefixes (batch-1 forwards), reused by later prefill groups."""

    def __init__(self, model: torch.nn.Module, device: torch.device, stats: GenerationStats) -> None:
        self.model, self.device, self.stats = model, device, stats
        self.memo: list[tuple[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]]] = []

    def lookup(self, prompts: Sequence[Sequence[int]]) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """The prefix to reuse for ``prompts`` (its length and per-layer ``(keys, values)`` ``[1, h, P, d]``), or
        ``(0, None)``: the longest known prefix every prompt starts with, or their common prefix computed now
        when that is longer (and at least :data:`SHARED_PREFIX_MIN` tokens). Every prompt keeps at least one
        token of its own to prefill (its last position's logits)."""
        limit = min(len(p) for p in prompts) - 1
        best = -1
        for j, (key, _) in enumerate(self.memo):
            longer = best < 0 or len(key) > len(self.memo[best][0])
            if len(key) <= limit and longer and all(tuple(p[: len(key)]) == key for p in prompts):
                best = j
        known = len(self.memo[best][0]) if best >= 0 else 0
        n = min(_common_prefix(prompts), limit) if len(prompts) > 1 else 0
        if n >= SHARED_PREFIX_MIN and n > known:
            key = tuple(prompts[0][:n])
            cache = new_cache(self.model)
            ids = torch.tensor([key], dtype=torch.long, device=self.device)
            model_forward(self.model, ids, cache, logits_to_keep=1)
            self.memo.insert(0, (key, [(k.clone(), v.clone()) for k, v in _kv(cache)]))
            del self.memo[SHARED_PREFIX_MEMO:]
            self.stats.prefix_forwards += 1
        elif best >= 0:
            self.memo.insert(0, self.memo.pop(best))
        else:
            return 0, None
        key, kv = self.memo[0]
        self.stats.prefix_tokens_reused += len(key) * len(prompts)
        return len(key), kv


def _prefill(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    device: torch.device,
    prefix: tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | None] = (0, None),
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Prefill prompts of similar length in one forward, left-padded to the longest (explicit positions and a
    padding mask: each row's computation is its own). Returns the last position's logits ``[n, V]`` and per layer
    ``(keys, values)`` ``[n, h, L, d]`` right-aligned, the padding columns zeroed (masked later, but a non-finite
    value there would still poison the attention sum).

    ``prefix``: ``(P, kv)`` from :class:`_PrefixMemo`: the first ``P`` tokens of every prompt are already cached
    (``kv``), so only the rest is computed, attending to them (the same positions, hence the same keys, values
    and logits up to float rounding); each row's prefix columns are then moved next to its own tokens."""
    plen, pkv = prefix
    rest = [p[plen:] for p in prompts]
    width = max(len(p) for p in rest)
    pads = [width - len(p) for p in rest]
    ids = torch.tensor([[0] * n + list(p) for n, p in zip(pads, rest, strict=True)], dtype=torch.long, device=device)
    n_rows = len(prompts)
    cache = (
        new_cache(model)
        if pkv is None
        else new_cache(model, [(k.expand(n_rows, -1, -1, -1), v.expand(n_rows, -1, -1, -1)) for k, v in pkv])
    )
    if not any(pads):
        positions = None if not plen else torch.arange(plen, plen + width, device=device).expand(n_rows, -1)
        res = model_forward(model, ids, cache, positions, logits_to_keep=1)
        return res.logits[:, -1], _kv(cache)
    pad = torch.tensor(pads, device=device)[:, None]
    cols = torch.arange(width, device=device)[None, :]
    mask = (cols >= pad).long()
    if plen:
        mask = torch.cat([mask.new_ones(n_rows, plen), mask], dim=1)
    res = model_forward(model, ids, cache, plen + (cols - pad).clamp(min=0), mask, logits_to_keep=1)
    kv = _kv(cache)
    for r, n in enumerate(pads):
        if n:
            for layer, (k, v) in enumerate(kv):
                if plen:  # [prefix | padding | own tokens] -> [padding | prefix | own tokens]
                    assert pkv is not None
                    k[r, :, n : n + plen] = pkv[layer][0][0]
                    v[r, :, n : n + plen] = pkv[layer][1][0]
                k[r, :, :n] = 0
                v[r, :, :n] = 0
    return res.logits[:, -1], kv


@torch.inference_mode()
def continuous_generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_token_id: int | Sequence[int] | None,
    batch_size: int = 32,
    stop_at_eos: bool = True,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    seeds: Sequence[int] | Callable[[int], int] | None = None,
    on_finish: Callable[[int, list[int]], None] | None = None,
    more: Callable[[int], Sequence[Sequence[int]]] | None = None,
    prepack: bool = True,
    share_prefix: bool = True,
) -> tuple[list[list[int]], GenerationStats]:
    """Generate up to ``max_new_tokens`` after every prompt, ``batch_size`` rows at a time (see module docstring).

    Prompts are admitted in the order given (sort them by length for the least padding in the shared cache and
    the most prompts prefilled together).

    Args:
        eos_token_id: end-of-sequence id(s); a row ends after emitting one (it is kept) when ``stop_at_eos``.
        stop_at_eos: False generates exactly ``max_new_tokens`` per prompt (replay's continuations).
        generator: sampling draws every slot's token from it in slot order (reproducible for the same prompts,
            batch size and seed); ignored when ``seeds`` is given.
        seeds: a sampling seed per prompt (a sequence, or a function of the prompt's index): each row samples
            from its own generator, so its tokens do not depend on which rows share its steps (streams, resumes).
        on_finish: called with (prompt index, tokens) as each row ends (progress bars, streaming writers).
        more: a feed of further prompts, called before every admission with the number of slots that the
            queue cannot fill (<= 0 when it can); what it returns is queued after everything queued so far and
            numbered after every prompt so far (``prompts`` first). The engine stops when nothing is queued or
            decoding and ``more`` returns nothing. With a feed, a row's prompt and tokens are let go once
            ``on_finish`` has them (the returned lists are empty): a stream's caller keeps what it needs.
        prepack: multiply by oneDNN-prepacked weights where the model is float32 on a CPU
            (:mod:`data.prepack`: 1.2x a decode step, the same greedy rows in every measurement).
        share_prefix: prompts prefilled together compute their common prefix once (at least
            :data:`SHARED_PREFIX_MIN` tokens; remembered for later groups), not once per prompt.

    Returns:
        the new tokens of every prompt (in index order) and the engine's counters.
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    seed_of = seeds if callable(seeds) or seeds is None else seeds.__getitem__
    # a shared prefix is prefilled apart from the left padding that follows it: positions stay exact, but the
    # column distances a sliding window is measured in would not
    share_prefix = share_prefix and sliding_window(model) is None
    with prepacked_linears(model, enabled=prepack, rows=batch_size):
        return _generate(
            model,
            prompts,
            max_new_tokens,
            eos_token_id,
            batch_size,
            stop_at_eos,
            temperature,
            top_p,
            generator,
            seed_of,
            on_finish,
            more,
            share_prefix,
        )


def _generate(
    model: torch.nn.Module,
    given: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None,
    batch_size: int,
    stop_at_eos: bool,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    seed_of: Callable[[int], int] | None,
    on_finish: Callable[[int, list[int]], None] | None,
    more: Callable[[int], Sequence[Sequence[int]]] | None,
    share_prefix: bool,
) -> tuple[list[list[int]], GenerationStats]:
    """:func:`continuous_generate`'s engine (arguments checked there)."""
    eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    device = next(model.parameters()).device
    prompts: list[Sequence[int]] = list(given)
    stats = GenerationStats(prompts=len(prompts))
    out: list[list[int]] = [[] for _ in prompts]
    queue = list(range(len(prompts)))
    queue.reverse()  # pop() from the end = the order given
    sampled = temperature > 0.0 and seed_of is not None
    gens: dict[int, torch.Generator] = {}  # per-row generators (seeds given), by prompt index

    def pick(logits: torch.Tensor, which: Sequence[int | None]) -> list[int]:
        """Next token of every row of ``logits``; ``which``: each row's prompt index (None: a free slot)."""
        if not sampled:
            return _pick(logits.float(), temperature, top_p, generator).tolist()
        picked = []
        for row, i in zip(logits, which, strict=True):
            if i is None:
                picked.append(0)
                continue
            if i not in gens:
                assert seed_of is not None
                gens[i] = torch.Generator(device=row.device).manual_seed(int(seed_of(i)))
            probs = logits_to_probs(row.float(), temperature, top_p)
            picked.append(int(torch.multinomial(probs, 1, generator=gens[i])))
        return picked

    def feed() -> None:
        if more is None:
            return
        new = list(more(batch_size - sum(i is not None for i in rows) - len(queue)))
        if new:
            first = len(prompts)
            prompts.extend(new)
            out.extend([] for _ in new)
            queue[:0] = reversed(range(first, len(prompts)))
            stats.prompts += len(new)

    headroom = max(1, DECODE_HEADROOM)
    memo = _PrefixMemo(model, device, stats) if share_prefix else None

    # Slots: buffer row r decodes prompt rows[r], or nothing (None: a free slot, fed token 0 with nothing cached and
    # its output ignored, until a prompt is admitted into it or the cache is compacted).
    rows: list[int | None] = []
    clen: list[int] = []  # cached positions of each slot's row (prompt + generated tokens already fed; 0 if free)
    nxt: list[int] = []  # the token each slot feeds next
    # The cache: per layer (keys, values) buffers [B, h, cap, d]; columns [start, end) are live, each row
    # right-aligned at `end` (its clen columns); everything left of a row's first column is masked (zero, or the
    # finite leftovers of the slot's earlier row). Room is kept left of `end` for the longest prompt still queued,
    # so that a prompt is admitted into a free slot in place; the buffers are rebuilt only to take more rows than
    # there are free slots, to compact when no free column is left on the right, and at the tail to drop free slots.
    bufs: list[tuple[torch.Tensor, torch.Tensor]] = []
    start = end = 0

    def ended(i: int) -> bool:
        toks = out[i]
        return len(toks) >= max_new_tokens or (stop_at_eos and toks[-1] in eos)

    def finish(i: int) -> None:
        gens.pop(i, None)
        stats.generated_tokens += len(out[i])
        if on_finish is not None:
            on_finish(i, out[i])
        if more is not None:  # a stream: the caller has the row; keep no prompt or tokens for the whole run
            prompts[i], out[i] = (), []

    while True:
        feed()
        if not queue and all(i is None for i in rows):
            break
        # admit: prefill new prompts (neighbours of similar length together) for the free slots
        admitted: list[tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]] = []
        t0 = time.perf_counter()
        free = [r for r, i in enumerate(rows) if i is None]
        live = len(rows) - len(free)
        take = [queue.pop() for _ in range(min(batch_size - live, len(queue)))]
        pos = 0
        for n in _prefill_groups([len(prompts[i]) for i in take]):
            group = take[pos : pos + n]
            pos += n
            ps = [prompts[i] for i in group]
            logits, kv = _prefill(model, ps, device, memo.lookup(ps) if memo is not None else (0, None))
            stats.prompt_tokens += sum(len(prompts[i]) for i in group)
            picked = pick(logits, group)
            alive: list[int] = []
            for r, i in enumerate(group):
                out[i].append(int(picked[r]))
                if ended(i):
                    finish(i)
                else:
                    alive.append(r)
            if len(alive) < len(group):
                if not alive:
                    continue
                idx = torch.tensor(alive, device=device)
                kv = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in kv]
                group = [group[r] for r in alive]
            admitted.append((group, kv))
        stats.prefill_seconds += time.perf_counter() - t0
        t0 = time.perf_counter()
        n_new = sum(len(group) for group, _ in admitted)
        widest = max((kv[0][0].shape[2] for _, kv in admitted), default=0)
        spare = len(free) - n_new  # free slots left after admission (negative: more rows than slots)
        if (
            spare < 0
            or widest > end  # a guard: the room kept left of `end` fits every queued prompt
            or (bufs and end == bufs[0][0].shape[2])
            or (not queue and spare > 0 and spare > (live + n_new) // 2)
        ):
            # rebuild the cache: live rows, then the admitted ones, right-aligned at a common column
            kept = [r for r, i in enumerate(rows) if i is not None]
            new_rows = [i for group, _ in admitted for i in group]
            width = max([clen[r] for r in kept] + [len(prompts[i]) for i in new_rows], default=0)
            new_end = max([width] + [len(prompts[i]) for i in queue])
            n_rows = len(kept) + len(new_rows)
            nb: list[tuple[torch.Tensor, torch.Tensor]] = []
            if n_rows:
                # per layer, keys and values each their own heads and width (multi-head latent attention's keys
                # are wider than its values)
                refs = bufs or admitted[0][1]
                nb = [
                    tuple(t.new_zeros((n_rows, t.shape[1], new_end + headroom, t.shape[3])) for t in kv)  # type: ignore[misc]
                    for kv in refs
                ]
            if kept:
                wk = max(clen[r] for r in kept)
                idx = torch.tensor(kept, device=device)
                for (k, v), (ok, ov) in zip(nb, bufs, strict=True):
                    k[: len(kept), :, new_end - wk : new_end] = ok[:, :, end - wk : end].index_select(0, idx)
                    v[: len(kept), :, new_end - wk : new_end] = ov[:, :, end - wk : end].index_select(0, idx)
            r0 = len(kept)
            for group, kv in admitted:
                wg = kv[0][0].shape[2]
                for (k, v), (gk, gv) in zip(nb, kv, strict=True):
                    k[r0 : r0 + len(group), :, new_end - wg : new_end] = gk
                    v[r0 : r0 + len(group), :, new_end - wg : new_end] = gv
                r0 += len(group)
            rows = [rows[r] for r in kept] + list(new_rows)
            clen = [clen[r] for r in kept] + [len(prompts[i]) for i in new_rows]
            nxt = [nxt[r] for r in kept] + [out[i][-1] for i in new_rows]
            bufs, end = nb, new_end
            stats.cache_rebuilds += 1
        else:
            # admit in place: each new row into a free slot, its prompt's columns ending at `end`
            slots = iter(free)
            for group, kv in admitted:
                wg = kv[0][0].shape[2]
                idx = torch.tensor([next(slots) for _ in group], device=device)
                for (k, v), (gk, gv) in zip(bufs, kv, strict=True):
                    k[idx, :, end - wg : end] = gk
                    v[idx, :, end - wg : end] = gv
                for r, i in zip(idx.tolist(), group, strict=True):
                    rows[r], clen[r], nxt[r] = i, len(prompts[i]), out[i][-1]
                stats.admitted_in_place += len(group)
        start = end - max(clen, default=0)
        live = sum(i is not None for i in rows)
        if not live:
            stats.decode_seconds += time.perf_counter() - t0
            continue
        # one decode step for every slot
        width = end - start
        lens = torch.tensor(clen, device=device)
        cols = torch.arange(width + 1, device=device)
        mask = (cols[None, :width] >= width - lens[:, None]).long()
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
        cache = slot_cache(model, bufs, start, end)
        res = model_forward(model, torch.tensor(nxt, device=device)[:, None], cache, lens[:, None], mask)
        picked = pick(res.logits[:, -1], rows)
        end += 1
        stats.decode_steps += 1
        stats.decode_slots += live
        stats.idle_slots += len(rows) - live
        for r, i in enumerate(rows):
            if i is None:
                continue
            out[i].append(int(picked[r]))
            clen[r] += 1
            nxt[r] = int(picked[r])
            if ended(i):
                finish(i)
                rows[r], clen[r], nxt[r] = None, 0, 0
        start = end - max(clen, default=0)
        stats.decode_seconds += time.perf_counter() - t0
    return out, stats
