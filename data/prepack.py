"""oneDNN-prepacked linear weights for the target's inference forwards on a CPU.

A decode step multiplies a few dozen rows by every weight matrix of the model. ``F.linear`` hands each product to
a general matrix-multiply routine that reorganises (packs) the weight matrix into its own blocked layout on every
call, so at 32 rows a step spends as much time copying weights as multiplying them. oneDNN can pack a weight once
(``torch.ops.mkldnn._reorder_linear_weight``, what inductor's CPU backend and vLLM's CPU build do) and multiply any
number of rows by the packed copy (``torch.ops.mkldnn._linear_pointwise``). Measured on a 2-core CPU with the
embedded SmolLM2-135M target in float32: a 32-row decode step 0.236 s -> 0.196 s, a 4 x 200-token prefill 1.90 s
-> 1.69 s; stage synth's continuous engine 1.23-1.31x the tokens/s with every greedy row identical
(BENCHMARKS).

The products are the same sums in another order: logits differ from ``F.linear``'s by float32 rounding (about
1e-6 relative), as they already do between batch sizes. :func:`prepacked_linears` swaps every ``nn.Linear``'s
``forward`` for the packed product inside a ``with`` block (the packed copies cost the weights' size in memory
while it lasts) and restores them after. Only float32 weights on a CPU are packed; a forward with gradients
enabled still goes through ``F.linear`` (the packed op has no backward).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["can_prepack", "prepacked_linears"]

_DEFAULT_ROWS = 32
"""The row count oneDNN is told to expect when it chooses the packed layout (any count works)."""


def can_prepack(model: nn.Module) -> bool:
    """Whether :func:`prepacked_linears` would pack ``model``'s linears: oneDNN present and float32 weights on a
    CPU."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    p = next(model.parameters(), None)
    return p is not None and p.device.type == "cpu" and p.dtype == torch.float32


def _packed_forward(
    module: nn.Linear, packed: torch.Tensor, original: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[torch.Tensor], torch.Tensor]:
    bias = module.bias.detach() if module.bias is not None else None

    def forward(x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu":
            return original(x)
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), packed, bias, "none", [], "")
        return y.view(*shape[:-1], y.shape[-1])

    return forward


@contextmanager
def prepacked_linears(model: nn.Module, enabled: bool = True, rows: int = _DEFAULT_ROWS) -> Iterator[int]:
    """Inside the block, ``model``'s float32 CPU ``nn.Linear`` layers multiply by oneDNN-packed weights.

    Yields how many layers were packed (0 when disabled, when :func:`can_prepack` is false, or when packing
    failed: the model then runs as before). Layers whose ``forward`` is already replaced (a nested block) are
    left alone. The weights must not change inside the block (the packed copies would be stale).
    """
    swapped: list[tuple[nn.Module, Any]] = []
    if enabled and can_prepack(model):
        try:
            for module in model.modules():
                # exactly nn.Linear: a subclass may do more in its forward (quantised, adapted layers)
                if type(module) is not nn.Linear or "forward" in module.__dict__:
                    continue
                w = module.weight
                if w.dtype != torch.float32 or w.device.type != "cpu":
                    continue
                packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows)
                original = module.forward
                swapped.append((module, original))
                module.forward = _packed_forward(module, packed, original)  # type: ignore[method-assign]
        except (RuntimeError, NotImplementedError, AttributeError) as e:
            logger.warning("prepacked linears unavailable here (%s); using F.linear", e)
            for module, _ in swapped:
                del module.__dict__["forward"]
            swapped = []
    try:
        yield len(swapped)
    finally:
        for module, _ in swapped:
            module.__dict__.pop("forward", None)
