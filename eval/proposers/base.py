"""The proposer interface used by :class:`eval.decoder.SpeculativeDecoder`.

A proposer produces a draft (:class:`eval.tree.DraftTree`, a chain or a tree) for the target to
verify.  The decoder owns the target, its KV cache, sampling and verification; the proposer owns
whatever it needs to draft (a small model and its cache, an n-gram index, EAGLE / Medusa heads).

Protocol, per generation::

    setup(temperature, top_p, generator)      # decoder's sampling settings (default: stored)
    begin(prompt_ids, target_out)             # after the target prefill
    loop:
        tree = propose(context)               # context = prompt + every committed token
        ... decoder verifies tree in one target forward ...
        commit(context, n_new, hidden)        # context now includes the n_new new tokens

Hidden-state invariant (for feature-level drafters such as EAGLE / EAGLE-3 / Medusa): after
``begin`` and after every ``commit`` the proposer has been given the target hidden states of
``context[:-1]`` -- every committed token except the last one, which the target has not processed
yet (it is the root of the next draft).  ``begin`` delivers the prompt rows, each ``commit`` the
rows of ``context[-n_new - 1 : -1]`` (the previous root plus the accepted draft tokens), taken from
the verification forward pass, so no extra target computation is needed.

Hidden-state dicts (``TargetOutput.hidden_states`` and ``commit``'s argument) map

* ``"last"`` -> ``[n, H]`` the final hidden states (after the final norm, the ``lm_head`` input);
* ``l`` (int, for every ``l`` in ``proposer.aux_hidden_layers``) -> ``[n, H]`` =
  ``outputs.hidden_states[l]`` of the HF forward with ``output_hidden_states=True`` (0 = embeddings,
  ``l`` = output of decoder layer ``l``; in transformers 5.x the last entry is post-norm).

They are only computed when ``needs_hidden_states`` is true (``None`` is passed otherwise).

References: Leviathan et al. 2023 (draft models); Saxena 2023 (prompt lookup decoding);
Cai et al. 2024 (Medusa); Li et al. 2024 (EAGLE, EAGLE-2) and 2025 (EAGLE-3).
"""

from __future__ import annotations

import copy
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from eval.sampling import logits_to_probs, sample_from_probs
from eval.tree import DraftTree

logger = logging.getLogger(__name__)

__all__ = ["Proposer", "Replayer", "TargetOutput"]


@dataclass
class TargetOutput:
    """What the decoder hands to :meth:`Proposer.begin` after the target prefill.

    Attributes:
        logits: ``[T, V]`` target logits of the prompt positions (replay passes the last row only, ``[1, V]``:
            no proposer reads the others).
        hidden_states: ``None`` unless the proposer ``needs_hidden_states``; else a dict as described
            in the module docstring with ``[T, H]`` tensors for the ``T`` prompt positions.
    """

    logits: torch.Tensor
    hidden_states: dict[int | str, torch.Tensor] | None = None


class Replayer(Protocol):
    """Drafting for many replayed prompts at once (:func:`eval.replay.replay_many`): a prompt is admitted into a
    slot with its traced sequence, then :meth:`propose` drafts after any of the admitted prompts' contexts in one
    batch. It must draft what the proposer's own :meth:`Proposer.propose` drafts after the same context (greedy).

    ``chain``: the proposer drafts a chain that it samples at temperature > 0; sampled replay then asks
    :meth:`path_q` instead (a replayer without it is not used for sampled replay). A tree, or a chain drafted by
    argmax (:attr:`Proposer.greedy_drafts`), is deterministic at any temperature, and :meth:`propose` serves
    sampled replay too."""

    chain: bool

    def path_q(self, items: Sequence[tuple[int, int]], temperature: float, top_p: float) -> list[list[float]]:
        """For each ``(slot, context length L)``: the drafter's probability of each of the traced sequence's next
        tokens ``seq[L], seq[L + 1], ...`` at its chain positions, drafting those very tokens (teacher-forced, as
        :attr:`Proposer.forced_tokens`), at ``temperature`` / ``top_p``; one value per chain position."""
        ...

    def admit(self, slot: int, seq: torch.Tensor, hidden: dict[int | str, torch.Tensor]) -> None:
        """Take a prompt into ``slot``: ``seq`` = prompt + continuation, ``hidden`` the target's states of its rows."""

    def release(self, slot: int) -> None:
        """Forget ``slot``'s prompt."""

    def propose(self, items: Sequence[tuple[int, int]]) -> list[DraftTree]:
        """The draft after each ``(slot, context length)``."""
        ...


class Proposer(ABC):
    """Base class for draft proposers (draft model, prompt lookup, EAGLE / Medusa heads, ...).

    Class attributes to override:
        name: short identifier used in logs / result tables.
        needs_hidden_states: ask the decoder for target hidden states (costs nothing extra in
            compute, only ``output_hidden_states=True`` memory).
        aux_hidden_layers: indices into HF ``hidden_states`` to deliver besides ``"last"``
            (EAGLE-3 uses a low, a middle and a high layer); ``None`` for none.
    """

    name: str = "proposer"
    needs_hidden_states: bool = False
    aux_hidden_layers: list[int] | None = None

    temperature: float = 0.0
    top_p: float = 1.0
    generator: torch.Generator | None = None

    def setup(self, temperature: float, top_p: float, generator: torch.Generator | None) -> None:
        """Receive the decoder's sampling settings before :meth:`begin` (stored on ``self``).

        A sampling proposer must draw its randomness from ``generator`` only and, when it samples
        its drafts, return the distributions it sampled from in ``DraftTree.draft_probs``.
        """
        self.temperature = temperature
        self.top_p = top_p
        self.generator = generator

    def fork(self) -> Proposer:
        """A copy for replaying another prompt concurrently (:mod:`eval.lanes`): it shares the weights and the settings,
        and :meth:`begin` gives it its own per-generation state. Override when ``begin`` does not reset every
        mutable attribute."""
        return copy.copy(self)

    def replayer(self, slots: int, max_len: int) -> Replayer | None:
        """A :class:`Replayer` with ``slots`` slots for traced sequences of up to ``max_len`` tokens, or None when
        this proposer drafts one prompt at a time in replay (the default)."""
        return None

    greedy_drafts: bool = False
    """Draft a chain by argmax at any temperature (vLLM's default ``draft_sample_method="greedy"``): the chain is
    then deterministic (no ``draft_probs``), verified with delta proposals (accepted with probability ``p(x)``),
    lossless like any draft. False: sample it from q at temperature > 0 (Leviathan et al. 2023)."""

    forced_tokens: list[int] | None = None
    """Sampled replay's hook (:mod:`eval.replay`, also ``eval.expected.expected_acceptance``): when set,
    :meth:`draft_token` drafts these tokens in order instead of choosing (still recording each position's q), so a
    chain drafter's proposal distributions can be read along a given path. Never set during decoding."""

    def draft_token(self, logits: torch.Tensor, sampled_from: list[torch.Tensor]) -> int:
        """Pick one chain draft token from ``logits`` ``[V]``: argmax at temperature 0, else a sample from
        q = logits_to_probs(logits) (drawn from ``self.generator``), with q appended to ``sampled_from``
        (the chain's ``draft_probs``, needed for lossless rejection sampling). With :attr:`greedy_drafts`: argmax."""
        if self.greedy_drafts:
            return int(logits.argmax())
        if self.forced_tokens is not None:
            sampled_from.append(logits_to_probs(logits, self.temperature or 1.0, self.top_p).cpu())
            return int(self.forced_tokens.pop(0)) if self.forced_tokens else int(logits.argmax())
        if self.temperature == 0.0:
            return int(logits.argmax())
        q = logits_to_probs(logits, self.temperature, self.top_p)
        sampled_from.append(q.cpu())
        return sample_from_probs(q, self.generator)

    @abstractmethod
    def begin(self, prompt_ids: torch.Tensor, target_out: TargetOutput) -> None:
        """Start a new generation; called once after the target prefill.

        Args:
            prompt_ids: ``LongTensor[T]`` the prompt.
            target_out: prefill outputs (hidden states only if ``needs_hidden_states``).
        """

    @abstractmethod
    def propose(self, context: torch.Tensor) -> DraftTree:
        """Draft continuations of ``context`` (``LongTensor[T]``, prompt + committed tokens).

        The root of the returned tree is ``context[-1]``.  An empty tree is allowed.  The decoder
        may drop nodes deeper than the remaining token budget.
        """

    def commit(
        self,
        context: torch.Tensor,
        n_new: int,
        hidden_states_of_accepted: dict[int | str, torch.Tensor] | None,
    ) -> None:
        """Called after every verification step (default: no-op).

        Args:
            context: ``LongTensor[T']`` the new committed context (``n_new`` tokens longer).
            n_new: tokens appended this step (accepted draft tokens + 1 bonus/correction token).
            hidden_states_of_accepted: ``None`` unless ``needs_hidden_states``; else ``[n_new, H]``
                tensors for positions ``context[-n_new - 1 : -1]`` (see module docstring).
        """
        return None
