"""A Llama-style decoder layer for draft heads, with an explicit key/value cache and custom masks.

Weight names match Hugging Face Llama (``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``,
``input_layernorm``, ``post_attention_layernorm``) so exported heads load in EAGLE/SGLang/vLLM.
RoPE, RMSNorm and the MLP are taken from transformers' Llama code (not vendored); attention is written
here because draft heads need (a) a cache they can extend and drop at will and (b) tree masks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb, rotate_half

from data.config import ConfigError
from data.modeling import text_config
from eval.shared_past import SharedPast, shared_attention

KV = tuple[torch.Tensor, torch.Tensor]
"""``(keys, values)``, each ``[B, n_kv_heads, S, head_dim]`` (keys already rotated)."""

ROPE_KEYS = (
    "rope_type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
    "attention_factor",
    "mscale",
    "mscale_all_dim",
    "truncate",
    "long_factor",
    "short_factor",
)
"""The RoPE parameters a draft layer takes over from its target (not ``partial_rotary_factor``: the draft layer
rotates every dimension of its heads, as a Llama layer and the engines' EAGLE draft layers do)."""


def _rope_parameters(tcfg: Any) -> dict[str, Any]:
    rope = getattr(tcfg, "rope_parameters", None) or getattr(tcfg, "rope_scaling", None) or {}
    if isinstance(rope, dict) and "full_attention" in rope:  # per layer type (Gemma 3): the global layers' RoPE
        rope = rope["full_attention"]
    rope = {k: v for k, v in dict(rope).items() if k in ROPE_KEYS and v is not None}
    rope.setdefault("rope_theta", float(getattr(tcfg, "rope_theta", None) or 10000.0))
    rope.setdefault("rope_type", rope.pop("type", "default"))
    return rope


def draft_layer_config(target_config: Any) -> LlamaConfig:
    """The config of a feature head's draft decoder layers, derived from the target's dimensions, whatever its
    architecture (Llama, Qwen, Mistral, Gemma, Phi, MoE ...): a Llama layer (SwiGLU MLP, RMSNorm, RoPE, no biases)
    with the target's hidden size, attention heads, KV heads and head dim, its RoPE (the global layers' for
    targets that mix sliding and full attention), norm eps, context length and vocabulary. The draft MLP has the
    target's dense ``intermediate_size`` (an MoE target's expert width when it has none). This is what the
    engines build the draft layer from (vLLM's and SGLang's Llama EAGLE / EAGLE-3 draft models, speculators'
    ``transformer_layer_config``), so it is also what the exports write. For a Llama target it is the target's
    own layer config."""
    t = text_config(target_config)
    H = int(t.hidden_size)
    heads = int(t.num_attention_heads)
    kv = int(getattr(t, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(t, "head_dim", None) or H // heads)
    inter = getattr(t, "intermediate_size", None) or getattr(t, "moe_intermediate_size", None) or 4 * H
    eps = getattr(t, "rms_norm_eps", None) or getattr(t, "layer_norm_eps", None) or getattr(t, "norm_eps", None)
    special = {k: getattr(t, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return LlamaConfig(
        vocab_size=int(t.vocab_size),
        hidden_size=H,
        intermediate_size=int(inter),
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=int(getattr(t, "max_position_embeddings", None) or 4096),
        rms_norm_eps=float(eps or 1e-6),
        rope_parameters=_rope_parameters(t),
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        **special,
    )


class DraftAttention(nn.Module):
    """Multi-head attention with grouped KV heads; ``in_features`` may exceed ``hidden`` (EAGLE-3: 2H)."""

    def __init__(self, config: object, in_features: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.n_heads = config.num_attention_heads
        self.n_kv = getattr(config, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.n_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(in_features, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_features, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=bias)
        self.window: int | None = None
        """Sliding-window attention (``sliding_window`` of a Llama config): a query at position ``p`` sees only the keys
        at positions above ``p - window``; None = every key. Applied where the caller passes the queries'
        ``positions``. The committed keys (a plain past's first entries, a :class:`SharedPast`'s shared part, step 0
        of a TTT unroll) sit at the index of their position; draft entries appended after them are positions
        within a draft's length of the query, which callers keep below the window (:func:`check_window`), so
        comparing key *indices* with query positions is exact."""

    def _in_window(self, positions: torch.Tensor | None, keys: int, device: torch.device) -> torch.Tensor | None:
        """``[B or 1, T, keys]`` bool: which key indices each query may see under the window (None: no window)."""
        if self.window is None or positions is None:
            return None
        return torch.arange(keys, device=device)[None, None, :] > positions[:, :, None] - int(self.window)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past: KV | SharedPast | None = None,
        mask: torch.Tensor | None = None,
        queries: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, KV]:
        """x: ``[B, T, in]``; mask: bool ``[B or 1, 1, T, S_past + T]`` (True = attend) or None = causal.

        ``queries`` (``[B, Q]`` indices into the T positions): keys and values for all T positions, queries (and
        the output, ``[B, Q, hidden]``) only for those; ``mask`` is then ``[B, 1, Q, S_past + T]`` and required.
        Training uses it where only some positions' outputs are needed (the rest serve as context).
        ``positions`` (``[B or 1, T]``, the T positions' indices): with :attr:`window` set, each query's keys are
        limited to the window.

        Returns the output ``[B, T or Q, hidden]`` and the keys/values of the past plus these T positions (with a
        :class:`SharedPast`: its private part plus these positions; ``mask`` is then unused).
        """
        B, T, _ = x.shape
        if queries is None:
            q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
            k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
            v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
        else:
            if mask is None or isinstance(past, SharedPast):
                raise ValueError("attention over a subset of queries needs an explicit mask and a plain past")
            Q = queries.shape[1]
            x_q, cos_q, sin_q = (gather_rows(t, queries) for t in (x, cos, sin))
            k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
            v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
            q = self.q_proj(x_q).view(B, Q, self.n_heads, self.head_dim).transpose(1, 2)
            q = q * cos_q.unsqueeze(1) + rotate_half(q) * sin_q.unsqueeze(1)
            k = k * cos.unsqueeze(1) + rotate_half(k) * sin.unsqueeze(1)
        if queries is not None and positions is not None:
            positions = gather_rows(positions.expand(B, -1), queries)
        if isinstance(past, SharedPast):
            if past.private_k is not None and past.private_v is not None:
                k = torch.cat([past.private_k, k], dim=2)
                v = torch.cat([past.private_v, v], dim=2)
            out = shared_attention(q, k, v, past, self._in_window(positions, past.k.shape[2], x.device))
            out = out.transpose(1, 2).reshape(B, q.shape[2], self.n_heads * self.head_dim)
            return self.o_proj(out), (k, v)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        rep = self.n_heads // self.n_kv
        kr = k.repeat_interleave(rep, dim=1) if rep > 1 else k
        vr = v.repeat_interleave(rep, dim=1) if rep > 1 else v
        S = k.shape[2]
        window = self._in_window(positions, S, x.device)
        if mask is None and window is None:
            if S == T:
                out = F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
            else:  # causal over new positions, full over the past
                causal = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)
                out = F.scaled_dot_product_attention(q, kr, vr, attn_mask=causal)
        else:
            if mask is None:  # causal over new positions, full over the past
                mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)[None, None]
            out = F.scaled_dot_product_attention(
                q, kr, vr, attn_mask=mask if window is None else mask & window[:, None]
            )
        out = out.transpose(1, 2).reshape(B, q.shape[2], self.n_heads * self.head_dim)
        return self.o_proj(out), (k, v)


def check_window(window: int | None, longest_draft: int, what: str) -> None:
    """Refuse a sliding window a draft could outgrow: draft entries are compared with the window by index, which is
    exact only while every draft (a TTT unroll, a chain, a tree's depth) stays shorter than the window."""
    if window is not None and not int(window) > longest_draft:
        raise ConfigError(
            f"{what}={window}: the sliding window must be longer than the longest draft ({longest_draft})"
        )


def noise_features(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` plus Gaussian noise whose std is ``scale`` times each token's RMS over the last dimension (EAGLE's
    feature augmentation, per-token scaled); drawn from the global generator, which the training loop seeds per
    micro-batch (so resume stays exact)."""
    return x + torch.randn_like(x) * (scale * x.pow(2).mean(-1, keepdim=True).sqrt())


def lm_head_rows(lm_head: nn.Module, x: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """The target's logits for some vocabulary rows only (a draft vocabulary): ``lm_head(x)[:, target_ids]``
    (fp32) without the other rows' arithmetic."""
    weight = lm_head.weight[target_ids]
    bias = lm_head.bias[target_ids] if getattr(lm_head, "bias", None) is not None else None
    logits = nn.functional.linear(x, weight, bias)
    finish = getattr(lm_head, "finish", None)  # the architecture's logit transform (softcapping, scaling)
    return (finish(logits) if finish is not None else logits).float()


def gather_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t[b, index[b, i]]`` for ``t`` ``[B, T, ...]`` and ``index`` ``[B, Q]``: ``[B, Q, ...]``."""
    return t[torch.arange(t.shape[0], device=t.device)[:, None], index]


class DraftLayer(nn.Module):
    """One pre-norm Llama decoder layer. ``input_norm=False`` gives EAGLE-1's first layer (no input norm)."""

    def __init__(self, config: object, in_features: int | None = None, input_norm: bool = True) -> None:
        super().__init__()
        hidden = config.hidden_size
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=eps) if input_norm else None
        self.self_attn = DraftAttention(config, in_features or hidden)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past: KV | SharedPast | None = None,
        mask: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, KV]:
        """x: ``[B, T, in]``; ``residual`` defaults to ``x`` (EAGLE-3 passes the fused feature instead)."""
        residual = x if residual is None else residual
        h = self.input_layernorm(x) if self.input_layernorm is not None else x
        h, kv = self.self_attn(h, cos, sin, past, mask)
        h = residual + h
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, kv


class _SoftCrossEntropy(torch.autograd.Function):
    """``sum_i -(target_i . log_softmax(logits_i))`` in one pass over the vocabulary and one back.

    Written out because, on a CPU, the vocabulary-wide elementwise passes of the composite (a float copy,
    ``log_softmax``, a product with the target, its sum, then the backward of each) cost more than the head's
    matrix products: the loss is ``sum_i (lse_i * sum(target_i)) - target . logits`` (a dot product, no product
    tensor), the exponentials of the forward are kept for the backward, ``(softmax_i * sum(target_i) -
    target_i) * grad``. The row argmax comes free with the row max."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        work = torch.promote_types(logits.dtype, torch.float32)  # bf16 / fp16 logits are summed in float32
        z = logits.to(work)
        zmax, top = z.max(-1, keepdim=True)
        e = (z - zmax).exp_()
        s = e.sum(-1, keepdim=True)
        t = target.to(work)
        tsum = t.sum(-1, keepdim=True)
        lse = zmax + s.log()
        loss = (lse * tsum).sum() - torch.dot(t.reshape(-1), z.reshape(-1))
        ctx.save_for_backward(e, s, t, tsum)
        ctx.in_dtype = logits.dtype
        ctx.mark_non_differentiable(top)
        return loss, top.squeeze(-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _grad_top: torch.Tensor | None) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        e, s, t, tsum = ctx.saved_tensors
        g = torch.mul(e, tsum / s).sub_(t).mul_(grad)
        return g.to(ctx.in_dtype), None


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum over rows of -(target . log_softmax(logits)) in float32, argmax of each row)`` for ``[N, V]``
    logits (any float dtype; the gradient comes back in it) and a ``[N, V]`` float target distribution (no
    gradient). Equal to the composite up to float rounding (tests)."""
    if logits.shape != target.shape or logits.dim() != 2:
        shapes = f"{tuple(logits.shape)} and {tuple(target.shape)}"
        raise ValueError(f"soft_cross_entropy wants two [N, V] tensors, got {shapes}")
    loss, top = _SoftCrossEntropy.apply(logits, target.detach())
    return loss, top


ACCEPTANCE_LOSSES = ("tv", "lk", "lk_hybrid")
"""The acceptance-targeting losses :func:`acceptance_loss` computes (besides the default KL / soft cross-entropy)."""


def acceptance_loss(
    logits: torch.Tensor, target: torch.Tensor, kind: str, temperature: float = 1.0, eta: float = 3.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum over rows of the loss in float32, argmax of each row)`` for ``[N, V]`` draft logits and a ``[N, V]``
    target distribution ``p`` (no gradient), with ``q = softmax(logits / temperature)``.

    Lossless speculative sampling accepts a draft position with probability ``alpha = sum_v min(p_v, q_v)``, one
    minus the total-variation distance (Leviathan et al. 2023), which KL reaches only through a bound (Pinsker):

    * ``tv``: ``1 - alpha`` (the acceptance itself; its gradient vanishes where the distributions barely overlap);
    * ``lk``: ``-log(alpha)`` (gradient ``grad(TV) / alpha``: usable from a cold start; cross-entropy for a one-hot p);
    * ``lk_hybrid``: ``w KL(p || q) + (1 - w) (1 - alpha)`` with ``w = exp(-eta alpha)``, alpha not differentiated in
      ``w``: KL's strong gradient while the overlap is low, TV's acceptance target as it grows (Samarin et al., "LK
      Losses: Direct Acceptance Rate Optimization for Speculative Decoding", arXiv 2602.23881; eta 3 is their best).
    """
    if kind not in ACCEPTANCE_LOSSES:
        raise ValueError(f"unknown acceptance loss {kind!r} (one of {', '.join(ACCEPTANCE_LOSSES)})")
    logq = torch.log_softmax(logits.float() / temperature, dim=-1)
    p = target.detach().float()
    overlap = torch.minimum(logq.exp(), p).sum(-1)
    if kind == "tv":
        per = 1.0 - overlap
    elif kind == "lk":
        per = -torch.log(overlap.clamp_min(1e-6))
    else:
        kl = (p * (torch.log(p.clamp_min(1e-30)) - logq)).sum(-1)
        w = torch.exp(-eta * overlap.detach())
        per = w * kl + (1.0 - w) * (1.0 - overlap)
    return per.sum(), logits.detach().argmax(-1)
