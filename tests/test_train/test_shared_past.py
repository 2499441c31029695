"""Attention over a shared committed prefix plus private draft keys equals plain attention over their
concatenation with the combined mask (the draft heads' layer, grouped KV heads, rotary positions)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from eval.shared_past import SharedPast
from train.drafters.layers import DraftAttention


def test_shared_past_attention_equals_attention_over_the_concatenation() -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    attn = DraftAttention(cfg, 64).eval()
    rotary = LlamaRotaryEmbedding(cfg)
    B, S, P, T, d = 3, 11, 5, 4, 16
    k1, v1 = torch.randn(B, 2, S, d), torch.randn(B, 2, S, d)
    pk, pv = torch.randn(B, 2, P, d), torch.randn(B, 2, P, d)
    lengths = torch.tensor([11, 4, 7])  # each row sees its own prefix length of the padded committed part
    visible = (torch.arange(S)[None] < lengths[:, None])[:, None, None]
    private = torch.rand(B, 1, T, P + T) < 0.6
    for t in range(T):
        private[:, 0, t, P + t] = True  # every row attends at least to itself
    x = torch.randn(B, T, 64)
    pos = lengths[:, None] + torch.arange(T)[None]
    cos, sin = rotary(x, pos)
    with torch.no_grad():
        out, (k, v) = attn(x, cos, sin, SharedPast(k1, v1, visible, pk, pv, private))
        full_mask = torch.cat([visible.expand(B, 1, T, S), private], dim=-1)
        ref, (kr, vr) = attn(x, cos, sin, (torch.cat([k1, pk], 2), torch.cat([v1, pv], 2)), full_mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, kr[:, :, S:])  # the private part plus the new positions comes back
    torch.testing.assert_close(v, vr[:, :, S:])
    # a row's invisible committed keys do not matter
    k2 = k1.clone()
    k2[1, :, 4:] = 1e3
    with torch.no_grad():
        out2, _ = attn(x, cos, sin, SharedPast(k2, v1, visible, pk, pv, private))
    torch.testing.assert_close(out2, out)


def test_a_sliding_window_hides_the_committed_keys_out_of_reach_the_same_on_both_paths() -> None:
    """With ``window`` set, a query at position p sees committed keys at positions above p - window only: over a
    shared prefix (replay) and over a plain past (the decoder) alike, equal to an explicit mask of those keys; the
    private (draft) keys stay visible. Without positions the window does nothing."""
    torch.manual_seed(1)
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    attn = DraftAttention(cfg, 64).eval()
    rotary = LlamaRotaryEmbedding(cfg)
    B, S, P, T, d, W = 2, 12, 2, 3, 16, 5
    k1, v1 = torch.randn(B, 2, S, d), torch.randn(B, 2, S, d)
    pk, pv = torch.randn(B, 2, P, d), torch.randn(B, 2, P, d)
    lengths = torch.tensor([12, 9])
    visible = (torch.arange(S)[None] < lengths[:, None])[:, None, None]
    private = torch.ones(B, 1, T, P + T, dtype=torch.bool).tril(P)
    x = torch.randn(B, T, 64)
    pos = lengths[:, None] + torch.arange(T)[None]  # draft positions right after each row's prefix
    cos, sin = rotary(x, pos)
    reach = torch.arange(S)[None, None, :] > pos[:, :, None] - W  # [B, T, S]: committed keys in the window
    with torch.no_grad():
        free, _ = attn(x, cos, sin, SharedPast(k1, v1, visible, pk, pv, private), positions=pos)
        attn.window = W
        out, _ = attn(x, cos, sin, SharedPast(k1, v1, visible, pk, pv, private), positions=pos)
        # the reference: no window, plain attention over the concatenation with the keys out of reach masked by hand
        plain = torch.cat([(visible & reach[:, None]).expand(B, 1, T, S), private], dim=-1)
        past = (torch.cat([k1, pk], 2), torch.cat([v1, pv], 2))
        ref, _ = _no_window(attn)(x, cos, sin, past, plain)
        dec, _ = attn(x, cos, sin, past, torch.cat([visible.expand(B, 1, T, S), private], -1), positions=pos)
        unpositioned, _ = attn(x, cos, sin, SharedPast(k1, v1, visible, pk, pv, private))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dec, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unpositioned, free)
    assert not torch.allclose(out, free, atol=1e-3)  # the window hid keys that mattered


def _no_window(attn: DraftAttention) -> DraftAttention:
    import copy

    other = copy.deepcopy(attn)
    other.window = None
    return other
