"""Lockstep lanes: many replayed trajectories at once, every linear layer of the drafters batched across them.

(Used for the drafters without a batched replayer -- Medusa, standalone draft models. The feature heads draft for
many prompts in one model call instead, :class:`eval.proposers.feature_head.FeatureHeadReplayer`, which also
batches their attention and leaves no per-lane Python work under the GIL.)

Replay (:mod:`eval.replay`) walks one prompt's trajectory at a time, and a drafter drafts one token (or one tree
level) at a time, so on a CPU almost all of its time goes into matrix-*vector* products: each drafted token reads
every weight of the draft head and of its vocabulary projection from memory (the EAGLE-1 head's projection onto
SmolLM2's 49,152-row vocabulary alone is 113 MB of fp32) to use it for one row. Trajectories of different
prompts are independent, so running ``L`` of them side by side and sending every ``nn.Linear`` call of the drafter
through one matrix-*matrix* product per round reads each weight once for ``L`` rows.

How: each lane is a thread that runs the unchanged :func:`eval.replay.replay` on its own shallow copy of the
proposer (:meth:`Proposer.fork`). While lanes run, the drafters' ``nn.Linear`` modules route calls *from lane
threads* to a :class:`LaneBatcher` (calls from any other thread -- the target trace, prompt lookup -- go straight
to the layer). A lane that calls a linear layer waits until every running lane is waiting too; the last one to
arrive concatenates the rows per layer, runs one product per layer, hands each lane its rows and wakes them all.
Attention, key/value caches, tree building and acceptance stay per lane, exactly as in the sequential replay, so a
lane computes the same trajectory; only the linear layers' floating-point summation may differ in the last bit
between a 1-row and an ``n``-row product (a near-tie could then flip; how often is measured in BENCHMARKS).

A lane that has nothing to do (waiting for the next prompt's target trace) leaves the barrier, so the others do
not wait for it. Everything here is CPU-agnostic and also works on a GPU, where it batches the same way.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["LaneBatcher", "batchable_linears", "batched_linears"]

_local = threading.local()


@dataclass
class _Request:
    module: nn.Linear
    x: torch.Tensor
    out: torch.Tensor | None = None
    error: Exception | None = None
    round: int = 0
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class LaneBatcher:
    """The barrier and the batched products (see the module docstring)."""

    max_wait: int = 64
    """Rounds after which a waiting layer runs even if other layers have more lanes waiting (no lane starves)."""
    rounds: int = 0
    rows: int = 0
    products: int = 0
    _live: int = 0
    _pending: list[_Request] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @contextmanager
    def lane(self) -> Iterator[None]:
        """Mark the calling thread as a running lane for the duration of the block."""
        with self._lock:
            self._live += 1
        _local.batcher = self
        try:
            yield
        finally:
            _local.batcher = None
            with self._lock:
                self._live -= 1
                self._maybe_flush()

    @contextmanager
    def idle(self) -> Iterator[None]:
        """Leave the barrier while the calling lane waits for something else (its next prompt)."""
        with self._lock:
            self._live -= 1
            self._maybe_flush()
        _local.batcher = None
        try:
            yield
        finally:
            with self._lock:
                self._live += 1
            _local.batcher = self

    def _maybe_flush(self) -> None:  # caller holds the lock
        if self._pending and len(self._pending) >= self._live:
            self._flush()

    @torch.inference_mode()  # lanes replay in inference mode; the flush may run in a lane that is between calls
    def _flush(self) -> None:  # caller holds the lock: every live lane is waiting in call()
        """Run the layer most lanes wait for (and any layer a lane has waited on for ``max_wait`` rounds).

        Running only the largest group lets lanes that are a few layers apart fall into step: the ones behind
        catch up while the ones ahead wait, after which every round serves all of them at once."""
        groups: dict[int, list[_Request]] = {}
        for r in self._pending:
            groups.setdefault(id(r.module), []).append(r)
        largest = max(groups.values(), key=lambda g: (len(g), -g[0].round))
        run = [g for g in groups.values() if g is largest or self.rounds - g[0].round >= self.max_wait]
        for reqs in run:
            m = reqs[0].module
            try:
                flat = [r.x.reshape(-1, r.x.shape[-1]) for r in reqs]
                y = _linear(m, torch.cat(flat) if len(flat) > 1 else flat[0])
                start = 0
                for r, f in zip(reqs, flat, strict=True):
                    r.out = y[start : start + f.shape[0]].reshape(*r.x.shape[:-1], y.shape[-1])
                    start += f.shape[0]
                self.rows += start
                self.products += 1
            except Exception:  # one lane's bad input: compute each call alone, so only that lane fails
                for r in reqs:
                    try:
                        r.out = _linear(m, r.x)
                    except Exception as exc:  # re-raised in the lane that made the call
                        r.error = exc
            for r in reqs:
                r.done.set()  # wakes only the lanes whose layer ran
        ran = {id(r) for g in run for r in g}
        self._pending = [r for r in self._pending if id(r) not in ran]
        self.rounds += 1

    def call(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``module(x)`` computed together with the other lanes' calls of this round."""
        with self._lock:
            req = _Request(module, x, round=self.rounds)
            self._pending.append(req)
            self._maybe_flush()
        req.done.wait()
        if req.error is not None:
            raise req.error
        assert req.out is not None
        return req.out


def _linear(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, m.weight, m.bias)


def _routed_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    b: LaneBatcher | None = getattr(_local, "batcher", None)
    if b is None:  # not a lane thread: the target trace, prompt lookup, the main thread
        return _linear(module, x)
    return b.call(module, x)


def batchable_linears(proposer: Any, min_weight_numel: int = 0) -> list[nn.Linear]:
    """Every ``nn.Linear`` a proposer can call with at least ``min_weight_numel`` weights: those of the modules it
    holds (attributes that are modules, or bound methods of modules such as ``head.full_logits``). Smaller layers
    run in their lane directly (no barrier)."""
    roots: list[nn.Module] = []
    for v in vars(proposer).values():
        owner = getattr(v, "__self__", None)
        for m in (v, owner):
            if isinstance(m, nn.Module) and not any(m is r for r in roots):
                roots.append(m)
    seen: dict[int, nn.Linear] = {}
    for r in roots:
        for m in r.modules():
            # subclasses (quantised layers, LoRA) may compute differently: left alone
            if type(m) is nn.Linear and m.weight.numel() >= min_weight_numel:
                seen.setdefault(id(m), m)
    return list(seen.values())


@contextmanager
def batched_linears(modules: Sequence[nn.Linear]) -> Iterator[None]:
    """While the block runs, calls of these layers from lane threads go through the lane's batcher."""
    patched = []
    try:
        for m in modules:
            if "forward" in vars(m):
                continue  # already routed (shared between proposers)
            m.forward = _routed_forward.__get__(m)  # type: ignore[method-assign]
            patched.append(m)
        yield
    finally:
        for m in patched:
            del m.forward
