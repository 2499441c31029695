"""Model and key/value-cache primitives shared by synth's engine, the decoder, replay and the proposers.

One HF causal-LM forward with a cache whatever transformers calls its cache argument (:func:`model_forward`), the
language-model part of a (multimodal) config, sliding-window masks for tree attention, caches that speculative
decoding can roll back (crop, keep an accepted path), and the one logits -> probabilities rule (temperature,
top-p) that the target and every drafter sample with.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

__all__ = [
    "cache_keep_positions",
    "cache_seq_len",
    "crop_cache",
    "kv_layers",
    "layer_masks",
    "logits_to_probs",
    "model_forward",
    "new_cache",
    "sliding_window",
    "text_config",
]


@functools.lru_cache(maxsize=64)
def _cache_kwarg_for(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_kwarg(model: torch.nn.Module) -> str:
    """Name of the KV-cache kwarg: ``cache`` in recent 5.x, ``past_key_values`` before."""
    return _cache_kwarg_for(type(model))


def model_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    cache: Any,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    output_hidden_states: bool = False,
    logits_to_keep: int | torch.Tensor | None = None,
) -> Any:
    """One HF causal-LM forward with a KV cache (works with ``cache=`` and ``past_key_values=``).

    Args:
        input_ids: ``[B, n]``.
        cache: a ``DynamicCache`` (updated in place), or None for a forward without one.
        position_ids: optional ``[B, n]``.
        attention_mask: optional ``[B, n_past + n]`` 2D or ``[B, 1, n, n_past + n]`` 4D mask.
        logits_to_keep: only these positions' logits (an int keeps the last ones; a tensor lists positions).
    """
    kwargs: dict[str, Any] = (
        {_cache_kwarg(model): cache, "use_cache": True} if cache is not None else {"use_cache": False}
    )
    if logits_to_keep is not None:
        kwargs["logits_to_keep"] = logits_to_keep
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    if attention_mask is not None:
        if attention_mask.dim() == 4:  # a custom (tree) mask: the sliding windows are cut into it
            past = cache_seq_len(cache) if cache is not None else 0
            attention_mask = layer_masks(model, attention_mask, position_ids, past)
        kwargs["attention_mask"] = attention_mask
    if output_hidden_states:
        kwargs["output_hidden_states"] = True
    return model(input_ids=input_ids, **kwargs)


def text_config(config: Any) -> Any:
    """The language-model part of a model's config (multimodal configs nest it as ``text_config``)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def sliding_window(model: torch.nn.Module) -> int | None:
    """The attention window of ``model``'s sliding-window layers (Mistral, Gemma 2/3, GPT-OSS, Qwen2 with it on,
    ...), or None when every layer attends to the whole context."""
    cfg = text_config(model.config)
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return int(window) if "sliding_attention" in types else None
    return int(window) if getattr(cfg, "use_sliding_window", True) else None


def layer_masks(
    model: torch.nn.Module, mask: torch.Tensor, position_ids: torch.Tensor | None, past: int
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The ``attention_mask`` argument for a forward of ``mask`` over ``past`` cached positions.

    A 2D padding mask is passed on (the model builds each layer kind's mask from it). A custom 4D mask (a tree's
    ancestors) is used by transformers as given, for every layer: for a target with sliding-window layers the
    window is cut into it here from the positions (keys: ``0..past-1`` then ``position_ids``), as a dict per layer
    kind where the model mixes kinds (Gemma 2/3, GPT-OSS, Qwen2/3), else as the one mask (Mistral, Phi-3)."""
    window = sliding_window(model)
    if window is None or mask.dim() != 4:
        return mask
    B, _, n, S = mask.shape
    dev = mask.device
    q = position_ids if position_ids is not None else torch.arange(past, past + n, device=dev)[None]
    q = q.to(dev).expand(B, -1)
    k = torch.cat([torch.arange(past, device=dev)[None].expand(B, -1), q], dim=1)
    if k.shape[1] != S:
        raise ValueError(f"a 4D mask over {S} keys for {past} cached + {n} new positions")
    near = (k[:, None, :] > q[:, :, None] - window)[:, None]  # [B, 1, n, S]
    # boolean (True = attend) or additive (0 / the dtype's minimum)
    windowed = mask & near if mask.dtype == torch.bool else mask.masked_fill(~near, torch.finfo(mask.dtype).min)
    if getattr(text_config(model.config), "layer_types", None) is None:
        return windowed
    return {"full_attention": mask, "sliding_attention": windowed}


def new_cache(model: torch.nn.Module, kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> DynamicCache:
    """An empty ``DynamicCache`` for ``model``, or one holding ``kv`` (per layer ``(keys, values)``, each
    ``[B, h, L, d]``).

    Every layer keeps its whole context, sliding-window layers included (transformers' sliding layers drop the
    keys that left the window, so they cannot be rolled back to an earlier position, which speculative decoding
    does every step); the window is applied by the attention masks instead, so the logits are the same."""
    if kv is not None:
        return DynamicCache(ddp_cache_data=kv)
    return DynamicCache()


def kv_layers(cache: Any) -> list[Any]:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise NotImplementedError(f"unsupported cache type {type(cache).__name__} (no .layers)")
    for layer in layers:
        if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys") or not hasattr(layer, "values"):
            raise NotImplementedError(
                f"cache layer {type(layer).__name__} cannot be rolled back by slicing "
                "(only full-attention DynamicLayer caches are supported)"
            )
    return list(layers)


def cache_seq_len(cache: Any) -> int:
    """Number of tokens held by the cache."""
    return int(cache.get_seq_length())


def crop_cache(cache: Any, length: int) -> None:
    """Keep only the first ``length`` positions of every layer (in place).

    Not ``DynamicCache.crop``: its argument changed meaning between transformers releases (the length to keep
    in 4.x, the number of tokens to remove in 5.x, where a positive value is refused)."""
    for layer in kv_layers(cache):
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]


def cache_keep_positions(cache: Any, start: int, keep: Sequence[int]) -> None:
    """Keep positions ``[0, start)`` plus ``start + keep[j]`` (in this order) in every layer (in place).

    ``keep`` are offsets relative to ``start`` (e.g. root + accepted tree path); everything after
    ``start`` that is not listed is dropped.  A contiguous ``keep = [0, 1, ..., m-1]`` is a crop.
    """
    keep = [int(k) for k in keep]
    if keep == list(range(len(keep))):
        crop_cache(cache, start + len(keep))
        return
    for layer in kv_layers(cache):
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        idx = torch.tensor([start + k for k in keep], dtype=torch.long, device=layer.keys.device)
        layer.keys = torch.cat([layer.keys[..., :start, :], layer.keys.index_select(-2, idx)], dim=-2)
        layer.values = torch.cat([layer.values[..., :start, :], layer.values.index_select(-2, idx)], dim=-2)


def logits_to_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Turn logits into the sampling distribution used by BOTH the draft and the target
    (synth's engine, the eval decoder and every proposer).

    ``temperature == 0`` gives a one-hot distribution on the argmax (greedy decoding; ``top_p`` is
    ignored).  Otherwise ``softmax(logits / temperature)`` followed by a nucleus (top-p) filter
    (Holtzman et al., 2020): keep the smallest set of highest-probability tokens whose cumulative
    probability is ``>= top_p`` and renormalise.  ``top_p >= 1`` disables the filter.

    Args:
        logits: ``[..., V]`` float tensor.
        temperature: ``>= 0``.
        top_p: in ``(0, 1]``.

    Returns:
        ``[..., V]`` float32 probabilities summing to 1 on the last axis.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    logits = logits.float()
    if temperature == 0:
        idx = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros_like(logits).scatter_(-1, idx, 1.0)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True, stable=True)
    cum_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep_sorted = cum_before < top_p  # the first token is always kept (cum_before = 0)
    keep = torch.zeros_like(keep_sorted).scatter_(-1, sorted_idx, keep_sorted)
    probs = probs * keep
    return probs / probs.sum(dim=-1, keepdim=True)
