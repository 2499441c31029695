"""Replay evaluation: held-out acceptance at scale, without a target forward per decoding step.

At temperature 0 the acceptance of a drafter on a prompt is fully determined by the target's greedy
continuation of that prompt: the speculative decoder emits exactly that continuation, and at every step it
accepts the longest draft path whose tokens equal the continuation's next tokens, then adds the target's
next token (the bonus / correction). So once the continuation ``c`` of a prompt ``x`` is known:

1. one target forward over ``x + c`` (batch 1, the whole sequence at once) gives every hidden state a
   feature-level drafter is fed (prompt rows at ``begin``; the root and accepted rows at each ``commit``);
2. the trajectory is walked exactly as :class:`eval.decoder.SpeculativeDecoder` walks it -- same
   :class:`~eval.proposers.base.Proposer` calls in the same order, same truncation of the draft to the
   remaining budget, the same greedy walk (:func:`eval.sampling.greedy_walk`), same counters -- with the
   verification forward replaced by a lookup into ``c``.

A second drafter (or checkpoint, or chain vs tree) on the same prompts costs only its drafting: the
continuations are cached on disk (:class:`ContinuationCache`), the target trace is shared between all methods
of one evaluation and kept on disk for the next one (:class:`TraceCache`).

Continuations are generated *ignoring* the end-of-sequence token (up to the token budget): the decoder
verifies drafts that run past an eos (it counts them, then cuts the output at the eos), so the target's
greedy tokens after an eos are needed to count exactly what the decoder counts. The emitted text still stops
at the first eos.

Exactness: the trace forward and the decoder's incremental verification compute the same functions in a
different order, so fp32 rounding can in principle flip a near-tie (in the drafter's top-k or in the target's
greedy choice). The tests require identical steps and accepted counts for every family, chain and tree.

Many prompts at once (:func:`replay_many`, ``eval.replay_lanes``): the walk above is cheap; drafting is not, and
one prompt at a time it is made of matrix-vector products. A proposer with a batched
:meth:`~eval.proposers.base.Proposer.replayer` (the feature heads) drafts for every walked prompt in one model call
per draft position (:class:`_SteppedReplay`); the others run in lockstep threads with their linear layers batched
across prompts (:mod:`eval.lanes`). Either way each prompt's trajectory is the one :func:`replay` walks.

Sampling (temperature > 0, a :class:`~eval.traces.Sampling`): lossless speculative sampling emits text distributed
exactly like the target's own samples, so the walk follows a continuation *sampled* from the target (one per prompt
and seed, cached like the greedy ones). Given that path, the decoder's acceptance events have a known law:

* a deterministic draft (trees, top-k expansions, prompt lookup: delta proposals, see
  :func:`eval.sampling.verify_tree`): recursive rejection accepts child ``x`` with probability ``p(x)`` and otherwise
  samples from ``p`` without the children, so the next token is distributed as ``p`` and a child is accepted iff its
  token is that next token. The greedy walk along the sampled path *is* the decoder's trajectory, in law, exactly.
* a sampled chain (``x_j ~ q_j``, accepted with probability ``min(1, p_j(x_j) / q_j(x_j))``, Leviathan et al.
  2023): the chance that position ``j`` is accepted *and* the emitted token is ``y`` is ``min(p_j, q_j)(y)``, while
  ``y`` is emitted with probability ``p_j(y)``; so given the path, position ``j`` is accepted with probability
  ``r_j = min(1, q_j(y_j) / p_j(y_j))``, independently of the rest, where ``q_j`` is the drafter's distribution after
  the path's own tokens (the accepted drafts *are* those tokens, so reading ``q_j`` teacher-forced,
  :attr:`~eval.proposers.base.Proposer.forced_tokens`, is exact). The walk draws each acceptance from a generator
  seeded per prompt: its counters are one draw of the decoder's own law, step by step.

Both need only the target's probability of each path token (``TargetTrace.path_p``, from the same trace forward)
and the drafter's probability of the same tokens.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from eval.lanes import LaneBatcher, batchable_linears, batched_linears
from eval.metrics import DecodeStats
from eval.proposers.base import Proposer, Replayer, TargetOutput
from eval.sampling import children_lists, greedy_walk, uniform
from eval.traces import Sampling, TargetTrace, TraceCache, trace_target
from eval.tree import DraftTree

logger = logging.getLogger(__name__)

__all__ = ["hidden_rows", "replay", "replay_many", "union_hidden_layers"]


def hidden_rows(
    hidden: dict[int | str, torch.Tensor], layers: Sequence[int] | None, sl: slice
) -> dict[int | str, torch.Tensor]:
    d: dict[int | str, torch.Tensor] = {"last": hidden["last"][sl]}
    for layer in layers or []:
        d[int(layer)] = hidden[int(layer)][sl]
    return d


def _eos_set(eos_token_id: int | Sequence[int] | None) -> set[int]:
    return {eos_token_id} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id or []}


@dataclass
class _SampledPath:
    """What the sampled walk needs of one prompt's path: the target's probability of each path token and the
    generator of the acceptance draws."""

    p: list[float]
    generator: torch.Generator


def _sampled_path(sampling: Sampling, trace: TargetTrace) -> _SampledPath:
    if trace.path_p is None:
        raise ValueError("sampled replay needs the target's probabilities of the path tokens (trace with sampling)")
    seed = sampling.row_seed([-1, *trace.prompt.tolist()])  # not the path's own seed
    return _SampledPath(trace.path_p.tolist(), torch.Generator().manual_seed(seed))


def _verify(
    stats: DecodeStats,
    tree: DraftTree,
    cont: Sequence[int],
    n: int,
    max_new_tokens: int,
    eos: set[int],
    path: _SampledPath | None = None,
) -> tuple[int, int, bool]:
    """One replayed verification step after ``n`` emitted tokens: the decoder's truncation of the draft to the
    budget, its greedy walk against the continuation (or, for a sampled chain along a sampled ``path``, its
    acceptance draws, :func:`_verify_chain`), its counters. Returns (tokens emitted, drafts accepted, finished)."""
    tree = tree.truncate_depth(max_new_tokens - n - 1)
    tokens = tree.tokens.reshape(-1).tolist()
    if path is not None and tree.draft_probs is not None:
        if not tree.is_chain():
            raise ValueError("sampled replay walks sampled chains and deterministic drafts, not sampled trees")
        if tokens != list(cont[n : n + len(tokens)]):
            raise RuntimeError("a sampled chain in replay must draft the path's own tokens (Proposer.forced_tokens)")
        q = tree.draft_probs[torch.arange(len(tokens)), tree.tokens.reshape(-1).to(tree.draft_probs.device)]
        return _verify_chain(stats, q.tolist(), cont, n, max_new_tokens, eos, path)
    accepted, _ = greedy_walk(tokens, children_lists(tree.parents, len(tokens)), lambda _n, d: cont[n + d])
    last = accepted[-1] if accepted else -1
    has_child = any(p == last for p in tree.parents)
    return _emit(stats, len(accepted), has_child, len(tree), cont, n, max_new_tokens, eos)


def _verify_chain(
    stats: DecodeStats,
    q: Sequence[float],
    cont: Sequence[int],
    n: int,
    max_new_tokens: int,
    eos: set[int],
    path: _SampledPath,
) -> tuple[int, int, bool]:
    """A sampled chain's step along a sampled path: ``q[j]`` is the drafter's probability of path token ``n + j``
    (teacher-forced); position ``j`` is accepted with probability ``min(1, q[j] / p[n + j])`` (module docstring)
    until the first rejection. The chain is cut to the budget as the decoder cuts it."""
    q = list(q[: max(0, max_new_tokens - n - 1)])
    a = 0
    for j, qy in enumerate(q):
        # accept iff u < q / p  <=>  u * p < q  (p == 0, a path token the trace's rounding rules out: accept iff q > 0)
        if not uniform(path.generator) * path.p[n + j] < qy:
            break
        a += 1
    return _emit(stats, a, a < len(q), len(q), cont, n, max_new_tokens, eos)


def _emit(
    stats: DecodeStats,
    a: int,
    has_next: bool,
    proposed: int,
    cont: Sequence[int],
    n: int,
    max_new_tokens: int,
    eos: set[int],
) -> tuple[int, int, bool]:
    """Count a step that accepted ``a`` drafts (``has_next``: a draft at depth ``a + 1`` was verified too) and emit
    the accepted tokens and the bonus / correction from the path, cut at an eos or the budget."""
    stats.target_forwards += 1
    stats.record_step(a, a + int(has_next), proposed)
    emitted = 0
    for t in cont[n : n + a + 1]:  # accepted drafts equal the continuation; then the bonus token
        emitted += 1
        if t in eos or n + emitted >= max_new_tokens:
            return emitted, a, True
    return emitted, a, False


@torch.inference_mode()
def replay(
    proposer: Proposer,
    trace: TargetTrace,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None,
    sampling: Sampling | None = None,
) -> tuple[list[int], DecodeStats]:
    """Walk the speculative-decoding trajectory of ``proposer`` on ``trace`` (see module docstring): greedy, or
    along a sampled path at ``sampling`` (the trace made with the same sampling).

    Returns what :meth:`SpeculativeDecoder.generate` would return at temperature 0 (sampled: one draw of what it
    returns at ``sampling``'s temperature): the emitted tokens and the counters (tau, alpha_i, draft tokens, target
    forwards; the times hold drafting only).
    """
    eos = _eos_set(eos_token_id)
    cont = trace.continuation
    if max_new_tokens > len(cont):
        raise ValueError(f"the trace holds {len(cont)} continuation tokens, {max_new_tokens} requested")
    t_start = time.perf_counter()
    stats = DecodeStats(n_sequences=1)
    prompt = trace.prompt
    T = int(prompt.numel())
    seq = torch.cat([prompt, torch.tensor(cont, dtype=prompt.dtype, device=prompt.device)])
    if max_new_tokens <= 0:
        return [], stats
    need = proposer.needs_hidden_states
    if need and trace.hidden is None:
        raise ValueError(f"{proposer.name} needs target hidden states but the trace has none")
    layers = proposer.aux_hidden_layers
    stats.target_forwards += 1
    stats.prefill_forwards += 1
    path = _sampled_path(sampling, trace) if sampling is not None else None
    # sampled: a proposer's only randomness, its chain draws, is replaced by the path's tokens (forced_tokens); with
    # no generator any other draw fails loudly
    proposer.setup(sampling.temperature if sampling else 0.0, sampling.top_p if sampling else 1.0, None)
    hidden = hidden_rows(trace.hidden, layers, slice(0, T)) if need and trace.hidden is not None else None
    t0 = time.perf_counter()
    proposer.begin(prompt, TargetOutput(logits=trace.prompt_logits, hidden_states=hidden))
    stats.draft_time_s += time.perf_counter() - t0

    n = 1  # tokens emitted: the first comes from the prefill
    finished = cont[0] in eos or n >= max_new_tokens
    while not finished:
        L = T + n  # context length; the root is seq[L - 1]
        context = seq[:L]
        t0 = time.perf_counter()
        if path is not None:
            proposer.forced_tokens = list(cont[n:])
        try:
            tree = proposer.propose(context)
        finally:
            proposer.forced_tokens = None
        stats.draft_time_s += time.perf_counter() - t0
        emitted, a, finished = _verify(stats, tree, cont, n, max_new_tokens, eos, path)
        n += emitted
        if not finished:
            hidden = None
            if need and trace.hidden is not None:
                hidden = hidden_rows(trace.hidden, layers, slice(L - 1, L + a))
            t0 = time.perf_counter()
            proposer.commit(seq[: T + n], emitted, hidden)
            stats.draft_time_s += time.perf_counter() - t0
    stats.new_tokens = n
    stats.total_time_s = time.perf_counter() - t_start
    return cont[:n], stats


def union_hidden_layers(proposers: Sequence[Proposer]) -> tuple[bool, list[int]]:
    """Whether any proposer needs hidden states, and the union of their intermediate layers."""
    need = any(p.needs_hidden_states for p in proposers)
    layers = sorted({int(layer) for p in proposers for layer in (p.aux_hidden_layers or [])})
    return need, layers


LANE_MIN_WEIGHTS = 0
"""Linear layers with fewer weights than this run in their lane directly instead of through the batcher."""


@dataclass
class _Walk:
    """One prompt's replayed trajectory inside a :class:`_SteppedReplay` slot."""

    i: int
    trace: TargetTrace
    T: int
    n: int
    stats: DecodeStats
    path: _SampledPath | None = None


class _SteppedReplay:
    """Replay of many prompts through a proposer's :class:`~eval.proposers.base.Replayer`.

    Up to ``slots`` prompts are walked side by side: every round, one batched :meth:`Replayer.propose` drafts for
    all of them (sampled, for a chain: :meth:`Replayer.path_q`, the drafter's probabilities of the path's tokens),
    and each prompt then takes its own verification step (:func:`_verify`, the same as :func:`replay`). A prompt
    that finishes frees its slot for the next one. A prompt's ``draft_time_s`` is its admission (the head over its
    rows) plus an equal share of every round it took part in.
    """

    def __init__(
        self,
        replayer: Replayer,
        slots: int,
        max_new_tokens: int,
        eos: set[int],
        sink: Any,
        need_hidden: bool,
        sampling: Sampling | None = None,
    ) -> None:
        self.r = replayer
        self.sampling = sampling
        self.free = list(range(slots - 1, -1, -1))
        self.active: dict[int, _Walk] = {}
        self.max_new = max_new_tokens
        self.eos = eos
        self.sink = sink  # sink(i, tokens, stats)
        self.need_hidden = need_hidden
        self.rounds = 0

    @property
    def full(self) -> bool:
        return not self.free

    def admit(self, i: int, trace: TargetTrace) -> None:
        cont = trace.continuation
        if self.max_new > len(cont):
            raise ValueError(f"the trace holds {len(cont)} continuation tokens, {self.max_new} requested")
        stats = DecodeStats(n_sequences=1)
        if self.max_new <= 0:
            self.sink(i, [], stats)
            return
        stats.target_forwards += 1
        stats.prefill_forwards += 1
        if cont[0] in self.eos or self.max_new <= 1:
            stats.new_tokens = 1
            self.sink(i, cont[:1], stats)
            return
        if self.need_hidden and trace.hidden is None:
            raise ValueError("the replayed proposer needs target hidden states but the trace has none")
        slot = self.free.pop()
        t0 = time.perf_counter()
        seq = torch.cat([trace.prompt, torch.tensor(cont, dtype=trace.prompt.dtype, device=trace.prompt.device)])
        self.r.admit(slot, seq, trace.hidden or {})
        stats.draft_time_s += time.perf_counter() - t0
        path = _sampled_path(self.sampling, trace) if self.sampling is not None else None
        self.active[slot] = _Walk(i, trace, int(trace.prompt.numel()), 1, stats, path)

    def round(self) -> None:
        if not self.active:
            return
        items = [(slot, w.T + w.n) for slot, w in self.active.items()]
        t0 = time.perf_counter()
        sampled_chain = self.sampling is not None and self.r.chain
        drafts: Sequence[DraftTree | list[float]] = (
            self.r.path_q(items, self.sampling.temperature, self.sampling.top_p)  # type: ignore[union-attr]
            if sampled_chain
            else self.r.propose(items)
        )
        share = (time.perf_counter() - t0) / len(items)
        self.rounds += 1
        for (slot, _), draft in zip(items, drafts, strict=True):
            w = self.active[slot]
            w.stats.draft_time_s += share
            cont = w.trace.continuation
            if isinstance(draft, DraftTree):  # greedy, or a deterministic draft along a sampled path
                emitted, _, finished = _verify(w.stats, draft, cont, w.n, self.max_new, self.eos)
            else:
                assert w.path is not None
                emitted, _, finished = _verify_chain(w.stats, draft, cont, w.n, self.max_new, self.eos, w.path)
            w.n += emitted
            if finished:
                w.stats.new_tokens = w.n
                w.stats.total_time_s = w.stats.draft_time_s
                self.sink(w.i, w.trace.continuation[: w.n], w.stats)
                del self.active[slot]
                self.r.release(slot)
                self.free.append(slot)

    def drain(self) -> None:
        while self.active:
            self.round()


def replay_many(
    target_model: torch.nn.Module,
    proposers: dict[str, Proposer],
    prompts: Sequence[Any],
    continuations: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None,
    desc: str = "replay",
    lanes: int = 1,
    trace_cache: TraceCache | None = None,
    sampling: Sampling | None = None,
) -> tuple[dict[str, dict[str, list[DecodeStats]]], dict[str, dict[str, list[int]]], float]:
    """Replay every proposer on every prompt, one target trace per prompt shared by all proposers; with
    ``sampling``, along sampled continuations (``continuations`` drawn at the same sampling; module docstring).

    ``prompts`` are :class:`eval.heldout.Prompt` (source, id, input_ids). With ``lanes > 1`` up to that many prompts
    are replayed at once: by a proposer's batched :meth:`~eval.proposers.base.Proposer.replayer` where it has one
    (the feature heads: one head call per draft position for all prompts, :class:`_SteppedReplay`), else, for
    proposers with linear layers, in lane threads whose products are batched across prompts (:mod:`eval.lanes`).
    The traces are made in this thread, and proposers without linear layers (prompt lookup) run here too. Returns
    per proposer name: the per-prompt stats grouped by source (in prompt order), the outputs keyed
    ``"source:id"``, and the total seconds of the traces made (``trace_cache``: traces stored by an earlier run
    are read instead, and new ones stored). With lane threads, a prompt's ``draft_time_s`` is the time its lane
    took, waiting for the other lanes included.
    """

    need, layers = union_hidden_layers(list(proposers.values()))
    per_prompt: list[dict[str, tuple[list[int], DecodeStats]]] = [{} for _ in prompts]
    eos = _eos_set(eos_token_id)
    stepped: dict[str, _SteppedReplay] = {}
    if lanes > 1 and prompts:
        max_len = max(len(p.input_ids) for p in prompts) + max_new_tokens
        for name, prop in proposers.items():
            r = prop.replayer(min(lanes, len(prompts)), max_len)
            if r is not None and (sampling is None or not r.chain or hasattr(r, "path_q")):

                def sink(i: int, toks: list[int], st: DecodeStats, name: str = name) -> None:
                    per_prompt[i][name] = (toks, st)

                stepped[name] = _SteppedReplay(
                    r, min(lanes, len(prompts)), max_new_tokens, eos, sink, prop.needs_hidden_states, sampling
                )
    linears = (
        {name: batchable_linears(p, LANE_MIN_WEIGHTS) for name, p in proposers.items() if name not in stepped}
        if lanes > 1
        else {}
    )
    laned = [name for name in proposers if linears.get(name)]
    others = [name for name in proposers if name not in laned and name not in stepped]
    trace_s = 0.0
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", mininterval=5.0)

    def direct(i: int, trace: TargetTrace, names: Sequence[str]) -> None:
        for name in names:
            per_prompt[i][name] = replay(proposers[name], trace, max_new_tokens, eos_token_id, sampling)

    def step_in(i: int, trace: TargetTrace) -> None:
        for run in stepped.values():
            while run.full:
                run.round()
            run.admit(i, trace)

    def traces() -> Iterator[tuple[int, TargetTrace]]:
        nonlocal trace_s
        for i, (p, cont) in enumerate(zip(prompts, continuations, strict=True)):
            if trace_cache is not None:
                trace = trace_cache.get(target_model, p.input_ids, cont[:max_new_tokens], layers, need, sampling)
            else:
                trace = trace_target(target_model, p.input_ids, cont[:max_new_tokens], layers, need, sampling)
            trace_s += trace.seconds
            yield i, trace

    def complete() -> int:
        return sum(len(r) == len(proposers) for r in per_prompt)

    if not laned:
        for i, trace in traces():
            direct(i, trace, others)
            step_in(i, trace)
            bar.update(complete() - bar.n)
        for run in stepped.values():
            run.drain()
    else:
        n_lanes = min(lanes, len(prompts))
        batcher = LaneBatcher()
        work: queue.Queue[tuple[int, TargetTrace] | None] = queue.Queue(maxsize=n_lanes)
        errors: list[BaseException] = []

        def lane_main() -> None:
            forks = {name: proposers[name].fork() for name in laned}
            with batcher.lane():
                while True:
                    with batcher.idle():
                        item = work.get()
                    if item is None:
                        return
                    i, trace = item
                    try:
                        for name, prop in forks.items():
                            per_prompt[i][name] = replay(prop, trace, max_new_tokens, eos_token_id, sampling)
                    except BaseException as exc:  # reported by the main thread
                        errors.append(exc)

        all_linears = [m for name in laned for m in linears[name]]
        with batched_linears(all_linears):
            threads = [threading.Thread(target=lane_main, name=f"replay-lane-{j}", daemon=True) for j in range(n_lanes)]
            for t in threads:
                t.start()
            try:
                for i, trace in traces():
                    if errors:
                        break
                    direct(i, trace, others)
                    step_in(i, trace)
                    work.put((i, trace))
                    bar.update(complete() - bar.n)
                for run in stepped.values():
                    run.drain()
                while complete() < len(prompts) and not errors:  # the lanes' last prompts: keep the bar moving
                    time.sleep(0.5)
                    bar.update(complete() - bar.n)
            finally:
                for _ in threads:
                    work.put(None)
                for t in threads:
                    t.join()
        if errors:
            raise errors[0]
        logger.debug("replay lanes: %d rounds, %d products, %d rows", batcher.rounds, batcher.products, batcher.rows)
    for name, run in stepped.items():
        logger.debug("replay %s: %d batched drafting rounds", name, run.rounds)
    bar.update(len(prompts) - bar.n)
    bar.close()
    stats: dict[str, dict[str, list[DecodeStats]]] = {name: {} for name in proposers}
    outputs: dict[str, dict[str, list[int]]] = {name: {} for name in proposers}
    for p, res in zip(prompts, per_prompt, strict=True):
        for name in proposers:
            toks, s = res[name]
            stats[name].setdefault(p.source, []).append(s)
            outputs[name][f"{p.source}:{p.id}"] = toks
    return stats, outputs, trace_s
