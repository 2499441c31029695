"""Draft proposers for :class:`eval.decoder.SpeculativeDecoder` (see :mod:`eval.proposers.base`)."""

from __future__ import annotations

from eval.proposers.base import Proposer, TargetOutput
from eval.proposers.draft_model import DraftModelProposer
from eval.proposers.prompt_lookup import PromptLookupProposer

__all__ = ["DraftModelProposer", "PromptLookupProposer", "Proposer", "TargetOutput"]
