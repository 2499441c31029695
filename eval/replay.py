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
continuations are cached on disk (:class:`ContinuationCache`) and the target trace is shared between all
methods of one evaluation.

Continuations are generated *ignoring* the end-of-sequence token (up to the token budget): the decoder
verifies drafts that run past an eos (it counts them, then cuts the output at the eos), so the target's
greedy tokens after an eos are needed to count exactly what the decoder counts. The emitted text still stops
at the first eos.

Exactness: the trace forward and the decoder's incremental verification compute the same functions in a
different order, so fp32 rounding can in principle flip a near-tie (in the drafter's top-k or in the target's
greedy choice). The tests require identical steps and accepted counts for every family, chain and tree.

Sampling (temperature > 0) is not replayed: stage eval decodes for it (``eval.mode=decode``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from eval.decoder import _new_cache, model_forward
from eval.metrics import DecodeStats
from eval.proposers.base import Proposer, TargetOutput
from eval.sampling import children_lists, greedy_walk, logits_to_probs

logger = logging.getLogger(__name__)

__all__ = [
    "ContinuationCache",
    "TargetTrace",
    "bootstrap_tau_ci",
    "greedy_continuations",
    "replay",
    "trace_target",
]


# ----------------------------------------------------------------------------------------------
# greedy continuations (batched, eos ignored)
# ----------------------------------------------------------------------------------------------


@torch.inference_mode()
def greedy_continuations(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    pad_token_id: int,
    batch_size: int = 8,
    desc: str = "continuations",
) -> list[list[int]]:
    """The target's greedy continuation of every prompt, exactly ``max_new_tokens`` long (eos not a stop).

    Prompts are sorted by length and decoded in left-padded batches of ``batch_size`` with a KV cache
    (little padding, one forward per token per batch).

    Returns:
        one list of ``max_new_tokens`` token ids per prompt, in the input order.
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    bar = tqdm(total=len(prompts) * max_new_tokens, desc=desc, unit="tok", mininterval=5.0)
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.tensor([[pad_token_id] * (width - len(prompts[i])) + list(prompts[i]) for i in idx], device=device)
        attn = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in idx], device=device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        cache = _new_cache(model)
        res = model_forward(model, ids, cache, position_ids=pos, attention_mask=attn, logits_to_keep=1)
        nxt = res.logits[:, -1].float().argmax(-1)
        toks = [nxt]
        for _ in range(max_new_tokens - 1):
            attn = torch.cat([attn, attn.new_ones(len(idx), 1)], dim=1)
            pos = pos[:, -1:] + 1
            res = model_forward(model, nxt[:, None], cache, position_ids=pos, attention_mask=attn)
            nxt = res.logits[:, -1].float().argmax(-1)
            toks.append(nxt)
            bar.update(len(idx))
        bar.update(len(idx))
        rows = torch.stack(toks, dim=1).tolist()
        for j, i in enumerate(idx):
            out[i] = [int(t) for t in rows[j]]
    bar.close()
    return out


def _key(fingerprint: str, prompt: Sequence[int]) -> str:
    h = hashlib.sha256(f"{fingerprint}|".encode())
    h.update(",".join(map(str, prompt)).encode())
    return h.hexdigest()[:32]


class ContinuationCache:
    """Greedy continuations on disk (``continuations.jsonl``), keyed by target fingerprint and prompt.

    Made once (per synth run, or per traffic file) and reused by every later evaluation and training-time
    check; a stored continuation serves any shorter budget (greedy decoding's prefix). Missing or too short ones
    are generated in batches and the file is rewritten atomically after each batch, so a killed run keeps what
    it made.
    """

    def __init__(self, directory: str | Path, fingerprint: str) -> None:
        self.path = Path(directory) / "continuations.jsonl"
        self.fingerprint = fingerprint
        self._rows: dict[str, list[int]] = {}
        self._unwritable = False
        if self.path.is_file():
            for n, line in enumerate(self.path.read_text(encoding="utf-8").splitlines(), 1):
                try:
                    rec = json.loads(line)
                    self._rows[str(rec["key"])] = [int(t) for t in rec["tokens"]]
                except (ValueError, KeyError, TypeError) as exc:
                    logger.warning("%s:%d: unreadable continuation skipped (%s)", self.path, n, exc)

    def __len__(self) -> int:
        return len(self._rows)

    def _store(self) -> None:
        """Rewrite the cache file atomically; a cache that cannot be written (read-only synth dir, full disk) only
        costs a regeneration next time, so it is a warning, not a failure."""
        from train.atomic import atomic_write_text

        if self._unwritable:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(
                self.path, "".join(json.dumps({"key": k, "tokens": v}) + "\n" for k, v in self._rows.items())
            )
        except OSError as exc:
            self._unwritable = True
            logger.warning(
                "replay: cannot write the continuation cache %s (%s); continuing without it (set "
                "eval.continuations_dir to a writable directory to keep them)",
                self.path,
                exc,
            )

    def get(
        self,
        model: torch.nn.Module,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        pad_token_id: int,
        batch_size: int = 8,
    ) -> list[list[int]]:
        """Continuations of ``prompts`` (``max_new_tokens`` each), generating and storing the missing ones."""
        keys = [_key(self.fingerprint, p) for p in prompts]
        missing = sorted({k: i for i, k in enumerate(keys) if len(self._rows.get(k, ())) < max_new_tokens}.values())
        if missing:
            t0 = time.perf_counter()
            logger.info(
                "replay: generating %d greedy continuations x %d tokens (cached in %s)",
                len(missing),
                max_new_tokens,
                self.path,
            )
            step = max(batch_size * 4, 1)
            for s in range(0, len(missing), step):
                part = missing[s : s + step]
                outs = greedy_continuations(model, [prompts[i] for i in part], max_new_tokens, pad_token_id, batch_size)
                for i, toks in zip(part, outs, strict=True):
                    self._rows[keys[i]] = toks
                self._store()
            dt = time.perf_counter() - t0
            logger.info(
                "replay: %d continuations in %.1f s (%.1f tokens/s)",
                len(missing),
                dt,
                len(missing) * max_new_tokens / dt,
            )
        return [self._rows[k][:max_new_tokens] for k in keys]


# ----------------------------------------------------------------------------------------------
# the target trace and the replayed trajectory
# ----------------------------------------------------------------------------------------------


@dataclass
class TargetTrace:
    """One target forward over ``prompt + continuation[:-1]``: what every proposer is fed during replay.

    Attributes:
        prompt: the prompt ids ``[T]``.
        continuation: the target's greedy continuation (``N`` tokens, eos not a stop).
        hidden: ``"last"`` and the requested intermediate layers, ``[T + N - 1, H]`` each (None when no
            proposer needs hidden states).
        prompt_logits: ``[T, V]`` target logits of the prompt positions (what the decoder's prefill gives).
        seconds: wall time of the forward.
    """

    prompt: torch.Tensor
    continuation: list[int]
    hidden: dict[int | str, torch.Tensor] | None
    prompt_logits: torch.Tensor
    seconds: float = 0.0


@torch.inference_mode()
def trace_target(
    model: torch.nn.Module,
    prompt: Sequence[int],
    continuation: Sequence[int],
    hidden_layers: Sequence[int] | None,
    need_hidden: bool = True,
) -> TargetTrace:
    """Run the target once over ``prompt + continuation[:-1]`` (batch 1) and keep what replay needs."""
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    T = len(prompt)
    seq = torch.tensor([*prompt, *continuation[:-1]], dtype=torch.long, device=device)
    # no KV cache (nothing follows this forward) and logits of the prompt rows only (the continuation is known)
    keep = torch.arange(T, device=device)
    out = model_forward(model, seq[None], None, output_hidden_states=need_hidden, logits_to_keep=keep)
    prompt_logits = out.logits[0].float()
    hidden: dict[int | str, torch.Tensor] | None = None
    if need_hidden:
        hs = out.hidden_states
        hidden = {"last": hs[-1][0]}
        for layer in hidden_layers or []:
            hidden[int(layer)] = hs[int(layer)][0]
    return TargetTrace(
        prompt=seq[:T].clone(),
        continuation=[int(t) for t in continuation],
        hidden=hidden,
        prompt_logits=prompt_logits,
        seconds=time.perf_counter() - t0,
    )


def _rows(
    hidden: dict[int | str, torch.Tensor], layers: Sequence[int] | None, sl: slice
) -> dict[int | str, torch.Tensor]:
    d: dict[int | str, torch.Tensor] = {"last": hidden["last"][sl]}
    for layer in layers or []:
        d[int(layer)] = hidden[int(layer)][sl]
    return d


@torch.inference_mode()
def replay(
    proposer: Proposer,
    trace: TargetTrace,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None,
) -> tuple[list[int], DecodeStats]:
    """Walk the greedy speculative-decoding trajectory of ``proposer`` on ``trace`` (see module docstring).

    Returns what :meth:`SpeculativeDecoder.generate` would return at temperature 0: the emitted tokens and the
    counters (tau, alpha_i, draft tokens, target forwards; the times hold drafting only).
    """
    eos = {eos_token_id} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id or []}
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
    proposer.setup(0.0, 1.0, None)
    hidden = _rows(trace.hidden, layers, slice(0, T)) if need and trace.hidden is not None else None
    t0 = time.perf_counter()
    proposer.begin(prompt, TargetOutput(logits=trace.prompt_logits, hidden_states=hidden))
    stats.draft_time_s += time.perf_counter() - t0

    n = 1  # tokens emitted: the first comes from the prefill
    finished = cont[0] in eos or n >= max_new_tokens
    while not finished:
        L = T + n  # context length; the root is seq[L - 1]
        context = seq[:L]
        remaining = max_new_tokens - n
        t0 = time.perf_counter()
        tree = proposer.propose(context)
        stats.draft_time_s += time.perf_counter() - t0
        tree = tree.truncate_depth(remaining - 1)
        tokens = tree.tokens.reshape(-1).tolist()
        accepted, _ = greedy_walk(tokens, children_lists(tree.parents, len(tokens)), lambda _n, d, n=n: cont[n + d])
        stats.target_forwards += 1
        last = accepted[-1] if accepted else -1
        has_child = any(p == last for p in tree.parents)
        stats.record_step(len(accepted), len(accepted) + int(has_child), len(tree))
        a = len(accepted)
        emitted = 0
        for t in cont[n : n + a + 1]:  # accepted drafts equal the continuation; then the bonus token
            emitted += 1
            if t in eos or n + emitted >= max_new_tokens:
                finished = True
                break
        n += emitted
        if not finished:
            hidden = _rows(trace.hidden, layers, slice(L - 1, L + a)) if need and trace.hidden is not None else None
            t0 = time.perf_counter()
            proposer.commit(seq[: T + n], emitted, hidden)
            stats.draft_time_s += time.perf_counter() - t0
    stats.new_tokens = n
    stats.total_time_s = time.perf_counter() - t_start
    return cont[:n], stats


# ----------------------------------------------------------------------------------------------
# statistics
# ----------------------------------------------------------------------------------------------


def bootstrap_tau_ci(
    per_prompt: Sequence[DecodeStats], n_boot: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of tau over prompts (prompts resampled with replacement).

    tau of a sample is a ratio (tokens emitted over verification steps, pooled over its prompts), so each
    replicate pools the resampled prompts' counters the same way. NaN when there are no steps.
    """
    import numpy as np

    num = np.array([sum(a + 1 for a in s.accepted_lengths) for s in per_prompt], dtype=np.float64)
    den = np.array([len(s.accepted_lengths) for s in per_prompt], dtype=np.float64)
    if len(num) == 0 or den.sum() == 0:
        return math.nan, math.nan
    if len(num) == 1:
        t = float(num[0] / den[0]) if den[0] else math.nan
        return t, t
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(num), size=(n_boot, len(num)))
    d = den[idx].sum(1)
    taus = num[idx].sum(1)[d > 0] / d[d > 0]
    lo, hi = np.quantile(taus, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


def describe_interval(lo: float, hi: float) -> str:
    """``[lo, hi]`` with two decimals (``-`` when undefined)."""
    if math.isnan(lo) or math.isnan(hi):
        return "-"
    return f"[{lo:.2f}, {hi:.2f}]"


def union_hidden_layers(proposers: Sequence[Proposer]) -> tuple[bool, list[int]]:
    """Whether any proposer needs hidden states, and the union of their intermediate layers."""
    need = any(p.needs_hidden_states for p in proposers)
    layers = sorted({int(layer) for p in proposers for layer in (p.aux_hidden_layers or [])})
    return need, layers


def replay_many(
    target_model: torch.nn.Module,
    proposers: dict[str, Proposer],
    prompts: Sequence[Any],
    continuations: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None,
    desc: str = "replay",
    lanes: int = 1,
) -> tuple[dict[str, dict[str, list[DecodeStats]]], dict[str, dict[str, list[int]]], float]:
    """Replay every proposer on every prompt, one target trace per prompt shared by all proposers.

    ``prompts`` are :class:`eval.heldout.Prompt` (source, id, input_ids). With ``lanes > 1`` up to that many prompts
    are replayed at once by proposers with linear layers, their products batched across prompts
    (:mod:`eval.lanes`); the traces are made in this thread meanwhile, and proposers without linear layers (prompt
    lookup) run here too. Returns per proposer name: the per-prompt stats grouped by source (in prompt order), the
    outputs keyed ``"source:id"``, and the total trace seconds. With lanes, a prompt's ``draft_time_s`` is the
    time its lane took, waiting for the other lanes included.
    """
    from eval.lanes import LaneBatcher, batchable_linears, batched_linears

    need, layers = union_hidden_layers(list(proposers.values()))
    linears = {name: batchable_linears(p) for name, p in proposers.items()} if lanes > 1 else {}
    laned = [name for name in proposers if linears.get(name)]
    per_prompt: list[dict[str, tuple[list[int], DecodeStats]]] = [{} for _ in prompts]
    trace_s = 0.0
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", mininterval=5.0)

    def direct(i: int, trace: TargetTrace, names: Sequence[str]) -> None:
        for name in names:
            per_prompt[i][name] = replay(proposers[name], trace, max_new_tokens, eos_token_id)

    if not laned:
        for i, (p, cont) in enumerate(zip(prompts, continuations, strict=True)):
            trace = trace_target(target_model, p.input_ids, cont[:max_new_tokens], layers, need)
            trace_s += trace.seconds
            direct(i, trace, list(proposers))
            bar.update(1)
    else:
        import queue
        import threading

        n_lanes = min(lanes, len(prompts))
        batcher = LaneBatcher()
        work: queue.Queue[tuple[int, TargetTrace] | None] = queue.Queue(maxsize=n_lanes)
        errors: list[BaseException] = []
        done = threading.Semaphore(0)

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
                            per_prompt[i][name] = replay(prop, trace, max_new_tokens, eos_token_id)
                    except BaseException as exc:  # reported by the main thread
                        errors.append(exc)
                    done.release()

        others = [name for name in proposers if name not in laned]
        all_linears = [m for name in laned for m in linears[name]]
        with batched_linears(all_linears):
            threads = [threading.Thread(target=lane_main, name=f"replay-lane-{j}", daemon=True) for j in range(n_lanes)]
            for t in threads:
                t.start()
            try:
                for i, (p, cont) in enumerate(zip(prompts, continuations, strict=True)):
                    if errors:
                        break
                    trace = trace_target(target_model, p.input_ids, cont[:max_new_tokens], layers, need)
                    trace_s += trace.seconds
                    direct(i, trace, others)
                    work.put((i, trace))
                    while done.acquire(blocking=False):
                        bar.update(1)
            finally:
                for _ in threads:
                    work.put(None)
                for t in threads:
                    t.join()
        if errors:
            raise errors[0]
        bar.n = len(prompts)
        logger.info("replay lanes: %d rounds, %d products, %d rows", batcher.rounds, batcher.products, batcher.rows)
    bar.close()
    stats: dict[str, dict[str, list[DecodeStats]]] = {name: {} for name in proposers}
    outputs: dict[str, dict[str, list[int]]] = {name: {} for name in proposers}
    for p, res in zip(prompts, per_prompt, strict=True):
        for name in proposers:
            toks, s = res[name]
            stats[name].setdefault(p.source, []).append(s)
            outputs[name][f"{p.source}:{p.id}"] = toks
    return stats, outputs, trace_s


# ----------------------------------------------------------------------------------------------
# sampling: expected acceptance along a sampled path
# ----------------------------------------------------------------------------------------------


@dataclass
class ExpectedAcceptance:
    """Expected counters of a sampled speculative generation along one path (see :func:`expected_acceptance`).

    Attributes:
        steps: expected number of verification steps.
        tokens: tokens those steps emit (the path length minus the prefill's token).
        attempted / accepted: expected number of steps that verify / accept draft position ``j + 1``.
    """

    steps: float
    tokens: int
    attempted: list[float]
    accepted: list[float]

    def tau(self) -> float:
        return self.tokens / self.steps if self.steps > 0 else math.nan

    def alpha(self) -> list[float]:
        return [a / t if t > 0 else math.nan for a, t in zip(self.accepted, self.attempted, strict=True)]

    @staticmethod
    def pooled_tau(items: Sequence[ExpectedAcceptance]) -> float:
        steps = sum(x.steps for x in items)
        return sum(x.tokens for x in items) / steps if steps > 0 else math.nan


@torch.inference_mode()
def expected_acceptance(
    proposer: Proposer,
    target_model: torch.nn.Module,
    prompt: Sequence[int],
    path: Sequence[int],
    temperature: float,
    top_p: float,
    generator: torch.Generator,
) -> ExpectedAcceptance:
    """Expected acceptance of a sampling chain drafter, from the target's and the drafter's distributions along
    one sampled path (no decoding).

    ``path`` is a continuation sampled from the target at ``temperature`` / ``top_p`` (e.g. plain decoding's
    output: lossless speculative sampling emits text distributed exactly like it). At every position ``t`` of the
    path the drafter drafts a chain in sampling mode from the committed prefix, with proposal distributions
    ``q_1..q_K``; with ``p_j`` the target's distribution after the path's first ``t + j - 1`` tokens, the chance
    that draft position ``j`` is accepted given the earlier ones is ``beta_j(t) = sum_x min(p_j(x), q_j(x))``
    (Leviathan et al. 2023, Sec. 3: one minus the total variation distance). A step starting at ``t`` then emits
    ``m`` tokens with probability ``prod_{j<m} beta_j(t) (1 - beta_m(t))`` (the chain cut to the remaining budget
    as the decoder cuts it), and the probability that a step starts at ``t`` follows by dynamic programming from
    the first step (right after the prefill token). Expected steps, and expected attempts / acceptances per draft
    position, are sums over ``t`` weighted by that probability.

    Deeper positions are read with teacher forcing: the drafter drafts the path's own tokens
    (:attr:`Proposer.forced_tokens`), so ``q_j`` and ``p_j`` are both conditioned on the path. Exact for position 1;
    for deeper ones it takes the accepted drafts to be distributed like the target's own samples (they are
    distributed like ``min(p, q)`` renormalised). On a draft/target pair with alpha ~0.8 it matched the sampled
    decoder's tau to within 1.5% (tests/test_eval/test_replay.py); reading ``q_j`` after the drafter's own sampled
    tokens instead was 5-9% low.
    """
    need = proposer.needs_hidden_states
    layers = proposer.aux_hidden_layers
    trace = trace_target(target_model, prompt, list(path), layers, need_hidden=True)
    assert trace.hidden is not None
    lm_head = target_model.get_output_embeddings()

    def p_after(pos: int) -> torch.Tensor:  # the target's distribution after the token at sequence position pos
        return logits_to_probs(lm_head(trace.hidden["last"][pos][None])[0].float(), temperature, top_p)

    T = int(trace.prompt.numel())
    N = len(path)
    seq = torch.cat([trace.prompt, torch.tensor(list(path), dtype=trace.prompt.dtype)])
    proposer.setup(temperature, top_p, generator)
    proposer.begin(
        trace.prompt, TargetOutput(trace.prompt_logits, _rows(trace.hidden, layers, slice(0, T)) if need else None)
    )
    betas: dict[int, list[float]] = {}
    for n in range(1, N):  # the context holds n path tokens; the root is seq[T + n - 1]
        L = T + n
        proposer.forced_tokens = [int(t) for t in path[n:]]  # teacher forcing: draft the path's own tokens
        try:
            tree = proposer.propose(seq[:L]).truncate_depth(N - n - 1)
        finally:
            proposer.forced_tokens = None
        if len(tree) and (tree.draft_probs is None or not tree.is_chain()):
            raise ValueError(f"{proposer.name}: expected acceptance needs a sampled chain draft (draft_probs)")
        betas[n] = [
            float(torch.minimum(p_after(L - 1 + j), tree.draft_probs[j].float().to(seq.device)).sum())  # type: ignore[index]
            for j in range(len(tree))
        ]
        proposer.commit(seq[: L + 1], 1, _rows(trace.hidden, layers, slice(L - 1, L)) if need else None)
    start = [0.0] * (N + 1)
    if N > 1:
        start[1] = 1.0
    depth = max((len(b) for b in betas.values()), default=0)
    attempted, accepted = [0.0] * depth, [0.0] * depth
    for n in range(1, N):
        w = start[n]
        if w == 0.0:
            continue
        reach = 1.0  # P(all earlier positions accepted)
        for j, beta in enumerate(betas[n]):
            attempted[j] += w * reach
            accepted[j] += w * reach * beta
            start[n + j + 1] += w * reach * (1.0 - beta)  # j accepted, position j + 1 rejected: emits j + 1
            reach *= beta
        start[min(N, n + len(betas[n]) + 1)] += w * reach  # the whole chain accepted, plus the bonus
    return ExpectedAcceptance(sum(start[1:N]), max(0, N - 1), attempted, accepted)
