"""Continuous batching for the HF target: stage synth's generation engine and replay's continuations.

``model.generate`` on a left-padded batch (what stage synth used before) wastes work three ways on a CPU: every
prompt is prefilled at the width of the longest one in its batch (length-sorted batches of 16 were still 41%
padding), rows that end early keep occupying the batch until the longest one ends, and the batch is only as
large as its padding cost allows. This engine instead

* prefills each prompt alone, at its own length (prefill is compute-bound: batching it saves nothing, padding
  it costs everything it pads);
* decodes up to ``batch_size`` rows together, one token per row per step, with one key/value cache whose rows
  are left-aligned to a common width (masked columns cost attention only, not the MLP);
* drops a row as soon as it ends (end-of-sequence or its token budget) and admits the next prompt into the
  free slot (continuous batching), trimming cache columns that no row uses any more.

Greedy outputs equal batch-1 greedy decoding token for token (tests); each row's computation is its own (masks
and explicit positions), only the rounding of batched matrix products could in principle differ. Sampling
draws every row's token from one ``torch.Generator`` in slot order, so a run is reproducible for the same
prompts, batch size and seed.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

logger = logging.getLogger(__name__)

__all__ = ["GenerationStats", "continuous_generate", "model_forward", "new_cache"]


@dataclass
class GenerationStats:
    """What one :func:`continuous_generate` call did (tokens, forwards, time)."""

    prompts: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_slots: int = 0
    """Rows x decode steps: generated tokens / decode slots is the batch's occupancy."""
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds


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
        kwargs["attention_mask"] = attention_mask
    if output_hidden_states:
        kwargs["output_hidden_states"] = True
    return model(input_ids=input_ids, **kwargs)


def new_cache(model: torch.nn.Module, kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> DynamicCache:
    """An empty ``DynamicCache`` for ``model``, or one holding ``kv`` (per layer ``(keys, values)``, each
    ``[B, h, L, d]``)."""
    if kv is not None:
        return DynamicCache(ddp_cache_data=kv, config=model.config)
    try:
        return DynamicCache(config=model.config)
    except TypeError:  # very old signature
        return DynamicCache()


def _layers(cache: Any) -> list[Any]:
    layers = getattr(cache, "layers", None)
    if layers is None or any(not hasattr(layer, "keys") for layer in layers):
        raise NotImplementedError(f"continuous batching needs a DynamicCache with .layers (got {type(cache).__name__})")
    return list(layers)


def _kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in _layers(cache)]


def _pad_left(t: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, h, L, d]`` -> ``[B, h, n + L, d]`` with zeros in front."""
    if n <= 0:
        return t
    return torch.cat([t.new_zeros(*t.shape[:2], n, t.shape[3]), t], dim=2)


def _pick(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """Next token of every row of ``logits`` ``[B, V]``: argmax, or a sample at ``temperature`` / ``top_p``."""
    if temperature <= 0.0:
        return logits.argmax(-1)
    from eval.sampling import logits_to_probs

    probs = torch.stack([logits_to_probs(row, temperature, top_p) for row in logits])
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


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
    on_finish: Callable[[int, list[int]], None] | None = None,
) -> tuple[list[list[int]], GenerationStats]:
    """Generate up to ``max_new_tokens`` after every prompt, ``batch_size`` rows at a time (see module docstring).

    Prompts are admitted in the order given (sort them by length for the least padding in the shared cache).

    Args:
        eos_token_id: end-of-sequence id(s); a row ends after emitting one (it is kept) when ``stop_at_eos``.
        stop_at_eos: False generates exactly ``max_new_tokens`` per prompt (replay's continuations).
        on_finish: called with (prompt index, tokens) as each row ends (progress bars).

    Returns:
        the new tokens of every prompt (input order) and the engine's counters.
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    device = next(model.parameters()).device
    stats = GenerationStats(prompts=len(prompts))
    out: list[list[int]] = [[] for _ in prompts]
    queue = list(range(len(prompts)))
    queue.reverse()  # pop() from the end = the order given

    rows: list[int] = []  # prompt index of each batch row
    clen: list[int] = []  # cached positions of each row (prompt + generated tokens already fed)
    nxt: list[int] = []  # the token each row feeds next
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # [B, h, W, d] per layer, rows right-aligned

    def ended(i: int) -> bool:
        toks = out[i]
        return len(toks) >= max_new_tokens or (stop_at_eos and toks[-1] in eos)

    def finish(i: int) -> None:
        stats.generated_tokens += len(out[i])
        if on_finish is not None:
            on_finish(i, out[i])

    while queue or rows:
        # admit: prefill new prompts alone, at their own length, into the free slots
        admitted: list[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        t0 = time.perf_counter()
        while queue and len(rows) + len(admitted) < batch_size:
            i = queue.pop()
            ids = torch.tensor([list(prompts[i])], dtype=torch.long, device=device)
            cache = new_cache(model)
            res = model_forward(model, ids, cache, logits_to_keep=1)
            stats.prompt_tokens += ids.shape[1]
            out[i].append(int(_pick(res.logits[:, -1].float(), temperature, top_p, generator)[0]))
            if ended(i):
                finish(i)
                continue
            admitted.append((i, _kv(cache)))
        stats.prefill_seconds += time.perf_counter() - t0
        if admitted:
            width = max(clen + [len(prompts[i]) for i, _ in admitted])
            parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
            if kv is not None:
                grow = width - kv[0][0].shape[2]
                parts.append([(_pad_left(k, grow), _pad_left(v, grow)) for k, v in kv])
            for i, layer_kv in admitted:
                n = width - len(prompts[i])
                parts.append([(_pad_left(k, n), _pad_left(v, n)) for k, v in layer_kv])
                rows.append(i)
                clen.append(len(prompts[i]))
                nxt.append(out[i][-1])
            kv = [
                (torch.cat([p[layer][0] for p in parts]), torch.cat([p[layer][1] for p in parts]))
                for layer in range(len(parts[0]))
            ]
        if not rows:
            continue
        # one decode step for every row
        assert kv is not None
        t0 = time.perf_counter()
        width = kv[0][0].shape[2]
        lens = torch.tensor(clen, device=device)
        cols = torch.arange(width + 1, device=device)
        mask = (cols[None, :width] >= width - lens[:, None]).long()
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
        cache = new_cache(model, kv)
        res = model_forward(model, torch.tensor(nxt, device=device)[:, None], cache, lens[:, None], mask)
        picked = _pick(res.logits[:, -1].float(), temperature, top_p, generator).tolist()
        kv = _kv(cache)
        stats.decode_steps += 1
        stats.decode_slots += len(rows)
        keep: list[int] = []
        for r, i in enumerate(rows):
            out[i].append(int(picked[r]))
            clen[r] += 1
            nxt[r] = int(picked[r])
            if ended(i):
                finish(i)
            else:
                keep.append(r)
        if len(keep) < len(rows):
            rows, clen, nxt = [rows[r] for r in keep], [clen[r] for r in keep], [nxt[r] for r in keep]
            if keep:
                idx = torch.tensor(keep, device=device)
                kv = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in kv]
            else:
                kv = None
        if kv is not None:  # drop leading columns no row uses any more
            unused = kv[0][0].shape[2] - max(clen)
            if unused > 0:
                kv = [(k[:, :, unused:], v[:, :, unused:]) for k, v in kv]
        stats.decode_seconds += time.perf_counter() - t0
    return out, stats
