"""Attention over a shared, padded committed prefix plus per-row draft nodes (vectorised replay).

Replay (:mod:`eval.replay`) drafts from many prompts' prefixes in one model call. Their committed keys/values are
computed once per prompt (teacher-forced) and kept padded in a slot tensor; each drafting call attends to the
first positions of its row's prefix and to that row's own draft nodes. :class:`SharedPast` carries both parts and
:func:`shared_attention` computes softmax attention over them without concatenating the large committed part, so
it is read, not copied, per call. The draft heads' attention (``train.drafters.layers``) takes a ``SharedPast``
in place of its usual ``(keys, values)`` past.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["SharedPast", "shared_attention"]


@dataclass
class SharedPast:
    """A layer's past for drafting from many committed prefixes in one call.

    Row ``b`` of the batch sees the first positions of its own committed prefix (``k``/``v`` padded to a common
    length, ``visible`` says which) plus its own draft nodes (``private_*``, e.g. the tree ancestors run so far).
    Attention is computed over both parts without concatenating them, so the (large) committed keys are read,
    not copied, on every call; the layer returns the private keys/values extended by the new positions.

    Attributes:
        k, v: ``[B, n_kv, S, head_dim]`` committed keys (rotated) and values.
        visible: bool ``[B, 1, 1, S]`` (True = attend).
        private_k, private_v: ``[B, n_kv, P, head_dim]`` or None (no draft nodes yet).
        private_mask: bool ``[B, 1, T, P + T]`` over the private keys then the ``T`` new ones.
    """

    k: torch.Tensor
    v: torch.Tensor
    visible: torch.Tensor
    private_k: torch.Tensor | None
    private_v: torch.Tensor | None
    private_mask: torch.Tensor


def shared_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: SharedPast, window: torch.Tensor | None = None
) -> torch.Tensor:
    """Softmax attention of ``q`` ``[B, H, T, d]`` over ``past``'s committed keys and ``past.private_* + k/v``;
    ``window`` (bool ``[B or 1, T, S]``): which committed keys each query may also see (a sliding window)."""
    B, H, T, d = q.shape
    n_kv = k.shape[1]
    rep = H // n_kv
    qg = q.reshape(B, n_kv, rep * T, d) * (1.0 / math.sqrt(d))  # head h uses kv head h // rep: row r * T + t
    s1 = torch.matmul(qg, past.k.transpose(-1, -2))  # [B, n_kv, rep*T, S]
    visible = past.visible if window is None else past.visible & window[:, None].repeat(1, 1, rep, 1)
    s1 = s1.masked_fill(~visible, float("-inf"))
    s2 = torch.matmul(qg, k.transpose(-1, -2)).view(B, n_kv, rep, T, -1)
    s2 = s2.masked_fill(~past.private_mask[:, :, None], float("-inf")).view(B, n_kv, rep * T, -1)
    p = torch.softmax(torch.cat([s1, s2], dim=-1), dim=-1)
    S = s1.shape[-1]
    out = torch.matmul(p[..., :S], past.v) + torch.matmul(p[..., S:], v)
    return out.view(B, H, T, d)
