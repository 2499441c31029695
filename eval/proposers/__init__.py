"""Draft proposers for :class:`eval.decoder.SpeculativeDecoder` (see :mod:`eval.proposers.base`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from eval.proposers.base import Proposer, TargetOutput
from eval.proposers.prompt_lookup import PromptLookupProposer

if TYPE_CHECKING:
    from eval.proposers.draft_model import DraftModelProposer

__all__ = ["DraftModelProposer", "PromptLookupProposer", "Proposer", "TargetOutput"]


def __getattr__(name: str) -> Any:
    # lazy: draft_model imports eval.decoder, which imports eval.proposers.base (avoid a cycle)
    if name == "DraftModelProposer":
        from eval.proposers.draft_model import DraftModelProposer

        return DraftModelProposer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
