"""DFlash: a block-diffusion draft that proposes a whole block of tokens in one forward.

Chen et al., "DFlash: Block Diffusion for Flash Speculative Decoding" (z-lab, 2026); the layout follows the
speculators ``dflash`` model and the engines' DFlash drafts (vLLM ``DFlashDraftModel`` / ``qwen3_dflash``,
SGLang ``--speculative-algorithm DFLASH``), the math and the training rule written here from their description.

The draft reads ``k`` target layers (HF ``hidden_states`` indices ``layer_ids``; default ``(2, N//2, N-3)``, as
speculators chooses), concatenated and fused per position: ``rows = hidden_norm(fc(concat))`` (``fc: kH -> H``, no
bias). Each of its ``num_layers`` Qwen3-style decoder layers (per-head q/k norms, SwiGLU MLP, the target's
dimensions) attends with queries from the block and keys/values from ``[rows of the context | the block]``: the
context's keys and values come from ``rows`` directly (``k_norm(k_proj(rows))``, ``v_proj(rows)``), the same rows
for every layer, so they are computed once per committed position and cached.

A block after the committed context ``x[0..n]`` is ``[x[n], M, ..., M]`` (``block_size`` tokens, ``M`` the mask
token) at positions ``n .. n + block_size - 1``; it attends to the target rows of positions ``< n`` and,
bidirectionally, to itself. Output position ``k >= 1`` is the draft distribution of ``x[n + k]`` (``lm_head(norm(.))``
over a reduced draft vocabulary with ``d2t``/``t2d``, like EAGLE-3's): ``block_size - 1`` draft tokens per forward.

Training (on the synth rows, the target's features online or precomputed): per row, ``anchors_per_row`` random
anchors ``a`` among the target-written positions; the block ``[x[a], M, ...]`` at positions ``a ..`` sees the
target rows of positions ``< a`` and itself; slot ``k`` is trained against the target's next-token distribution at
``a + k - 1`` (the one that verifies ``x[a + k]``) wherever ``x[a + k]`` is target-written, with weight
``exp(-(k - 1) / loss_gamma)`` (the DFlash position decay: early slots decide the accepted length). All anchors of a
batch run in one forward, each block masked to its own prefix.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from accelerate.utils import extract_model_from_parallel
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, rotate_half

from data.config import Bound, Choices, ConfigError, above, at_least
from eval.config import DRAFT_SHAPE_BOUNDS, Decode
from eval.proposers.dflash import DFlashProposer
from train.drafters.layers import KV, draft_layer_config, lm_head_rows, noise_features, soft_cross_entropy
from train.drafters.registry import DrafterSpec, TargetFeatures, TrainBatch, register
from train.drafters.saving import load_state, read_head, save_head
from train.drafters.vocab import (
    DraftVocab,
    check_saved_vocab,
    fused_features,
    init_draft_vocab,
    layer_ids_for,
    vocab_hash,
)


@dataclass
class DFlashConfig(Choices):
    """DFlash block draft and its decoding settings."""

    config_key: ClassVar[str] = "drafter"
    bounds: ClassVar[dict[str, Bound]] = {
        "layer_ids": at_least(0),
        "num_layers": at_least(1),
        "block_size": at_least(2),
        "anchors_per_row": at_least(1),
        "loss_gamma": above(0),
        "draft_vocab_size": at_least(0, "0: the full vocabulary"),
        "mask_token_id": at_least(0),
        "feature_noise": at_least(0),
        "teacher_temperature": above(0),
        **DRAFT_SHAPE_BOUNDS,
    }

    name: str = "dflash"
    layer_ids: list[int] | None = None
    """Target layers fused by ``fc`` (HF ``hidden_states`` indices); None = ``(2, N//2, N-3)``."""
    num_layers: int = 1
    """Draft decoder layers (the published drafts use 5 on 8B targets; one keeps a CPU draft step cheap)."""
    block_size: int = 8
    """Tokens per block: the anchor and ``block_size - 1`` drafted positions (vLLM's ``num_speculative_tokens``)."""
    anchors_per_row: int = 32
    """Training blocks per row, at random target-written positions (fewer if a row has fewer)."""
    loss_gamma: float = 1.0
    """Slot ``k``'s loss weight is ``exp(-(k - 1) / loss_gamma)``; speculators' default is 4 (at the quickstart budget
    1 gave held-out tau 1.25 against 1.22 for 2 and 1.16 for 4: the first slot decides every accepted run)."""
    draft_vocab_size: int = 8192
    """The draft vocabulary (the training data's most frequent target-written tokens); 0 = the full vocabulary."""
    mask_token_id: int | None = None
    """The token that fills a block's drafted positions (its embedding is the target's, frozen); None = the
    smallest id that never occurs in the training rows (a token the draft never reads as text)."""
    freeze_lm_head: bool = False
    """Keep the draft LM head at the target's rows instead of training it (with ``draft_vocab_size=0``: the target's
    own LM head, which SGLang's DFlash always uses; ``export=sglang_dflash`` needs it)."""
    feature_noise: float = 0.0
    """Training only: Gaussian noise on each target layer, this fraction of the token's RMS; 0 = none."""
    teacher_temperature: float = 1.0
    """Training only: the loss matches ``softmax(target logits / teacher_temperature)``."""
    decode: Decode = Decode.chain
    """chain (each block position's top token, DFlash as the engines run it) | tree (a static tree of the block
    positions' top-k ranks)."""
    chain_k: int = 7
    """Drafted tokens per step, at most ``block_size - 1``."""
    tree_depth: int = 7
    tree_top_k: int = 4
    tree_total_tokens: int = 16


class DFlashAttention(nn.Module):
    """Qwen3-style attention whose keys/values are ``[context rows | block]``; bidirectional inside the block."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        H = config.hidden_size
        self.n_heads = int(config.num_attention_heads)
        self.n_kv = int(getattr(config, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or H // self.n_heads)
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.q_proj = nn.Linear(H, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, H, bias=False)
        self.q_norm = LlamaRMSNorm(self.head_dim, eps=eps)
        self.k_norm = LlamaRMSNorm(self.head_dim, eps=eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> KV:
        """Rotated keys and values ``[B, n_kv, T, d]`` of ``x`` ``[B, T, H]``."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        return k * cos.unsqueeze(1) + rotate_half(k) * sin.unsqueeze(1), v

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: KV, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """``x`` ``[B, Q, H]`` block positions; ``ctx`` the context's keys/values ``[B, n_kv, S, d]``; ``mask`` bool
        ``[B, 1, Q, S + Q]`` (True = attend) or None (every key visible)."""
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.n_heads, self.head_dim)).transpose(1, 2)
        q = q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)
        kb, vb = self.kv(x, cos, sin)
        k, v = torch.cat([ctx[0], kb], 2), torch.cat([ctx[1], vb], 2)
        rep = self.n_heads // self.n_kv
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.n_heads * self.head_dim))


class DFlashLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: KV, mask: torch.Tensor | None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashHead(DraftVocab, nn.Module):
    """The draft: ``fc`` + ``hidden_norm`` over the target layers, ``num_layers`` block layers, ``norm``, ``lm_head``
    over the draft vocabulary (speculators' parameter names; the frozen embedding is the target's, not saved)."""

    def __init__(
        self,
        target_config: Any,
        layer_ids: list[int],
        num_layers: int,
        block_size: int,
        draft_vocab_size: int,
        mask_token_id: int = 0,
    ) -> None:
        super().__init__()
        config = draft_layer_config(target_config)
        config.num_hidden_layers = int(num_layers)
        H, V = config.hidden_size, config.vocab_size
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.config = config
        self.layer_ids = [int(i) for i in layer_ids]
        self.hidden_size = H
        self.block_size = int(block_size)
        self.embed_tokens = nn.Embedding(V, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(len(self.layer_ids) * H, H, bias=False)
        self.hidden_norm = LlamaRMSNorm(H, eps=eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(int(num_layers)))
        self.norm = LlamaRMSNorm(H, eps=eps)
        self.lm_head = nn.Linear(H, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[:draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.register_buffer("mask_token", torch.tensor([int(mask_token_id)], dtype=torch.long))
        self.rotary = LlamaRotaryEmbedding(config)

    @property
    def mask_token_id(self) -> int:
        return int(self.mask_token[0])

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``[..., k*H]`` concatenated target layers -> ``[..., H]`` context rows."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_kv(self, rows: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """Every layer's keys/values of context rows ``[B, S, H]`` at ``positions`` ``[B, S]``."""
        cos, sin = self.rotary(rows, positions)
        return [layer.self_attn.kv(rows, cos, sin) for layer in self.layers]

    def hidden(
        self, block_ids: torch.Tensor, positions: torch.Tensor, ctx: list[KV], mask: torch.Tensor | None
    ) -> torch.Tensor:
        """The normed outputs ``[B, Q, H]`` of block tokens ``block_ids`` ``[B, Q]`` at ``positions``."""
        x = self.embed_tokens(block_ids).to(self.fc.weight.dtype)
        cos, sin = self.rotary(x, positions)
        for layer, kv in zip(self.layers, ctx, strict=True):
            x = layer(x, cos, sin, kv, mask)
        return self.norm(x)

    def block_ids(self, anchors: torch.Tensor) -> torch.Tensor:
        """``[N, block_size]``: each anchor followed by mask tokens."""
        ids = self.mask_token.to(anchors.device).expand(anchors.shape[0], self.block_size).clone()
        ids[:, 0] = anchors
        return ids

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)

    def block_logits(self, anchors: torch.Tensor, positions: torch.Tensor, ctx: list[KV]) -> torch.Tensor:
        """Target-vocabulary logits ``[N, block_size - 1, V]`` of the tokens after each anchor (``[N]``, at
        ``positions`` ``[N]``), every context key visible."""
        pos = positions[:, None] + torch.arange(self.block_size, device=positions.device)
        return self.full_logits(self.hidden(self.block_ids(anchors), pos, ctx, None)[:, 1:])


def _check(cfg: DFlashConfig) -> None:
    if cfg.block_size < 2:
        raise ConfigError(f"drafter.block_size={cfg.block_size} must be >= 2 (the anchor and a drafted position)")


def build(cfg: DFlashConfig, target: Any) -> DFlashHead:
    _check(cfg)
    tcfg = target.config
    V = int(tcfg.vocab_size)
    vd = V if cfg.draft_vocab_size <= 0 or cfg.draft_vocab_size >= V else int(cfg.draft_vocab_size)
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else 0
    if not 0 <= mask < V:
        raise ConfigError(f"drafter.mask_token_id={mask} is outside the target's vocabulary (0..{V - 1})")
    head = DFlashHead(tcfg, layer_ids_for(cfg.layer_ids, tcfg), cfg.num_layers, cfg.block_size, vd, mask)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[:vd])
    head.lm_head.weight.requires_grad_(not cfg.freeze_lm_head)
    return head.to(next(target.parameters()).dtype)


def unused_token(rows: list[Any], vocab_size: int) -> int:
    """The smallest token id that occurs in none of ``rows`` (the default mask token)."""
    seen: Counter[int] = Counter()
    for r in rows:
        seen.update(r.input_ids)
    for t in range(vocab_size):
        if t not in seen:
            return t
    return min(range(vocab_size), key=lambda t: (seen[t], t))


def prepare(head: nn.Module, rows: list[Any], cfg: DFlashConfig, target: Any) -> dict[str, Any]:
    """The draft vocabulary and ``d2t``/``t2d`` from the training rows (the draft LM head starts at the target's
    rows), and the mask token when the config leaves it to the data."""
    assert isinstance(head, DFlashHead)
    info = init_draft_vocab(head, rows, target)
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else unused_token(rows, head.t2d.numel())
    with torch.no_grad():
        head.mask_token.fill_(int(mask))
    info["mask_token_id"] = int(mask)
    return info


def choose_anchors(can: torch.Tensor, per_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``per_row`` random anchors per row among ``can`` ``[B, L]`` (bool), in position order: ``(anchors
    [B, A], valid [B, A])`` with ``A = min(per_row, most candidates in a row)``. Drawn from the global generator,
    which the training loop seeds per micro-batch (so resume stays exact)."""
    A = max(min(int(per_row), int(can.sum(1).max())), 1)
    score = torch.rand(can.shape, device=can.device).masked_fill(~can, -1.0)
    top = score.topk(A, dim=1)
    order = torch.argsort(torch.where(top.values >= 0, top.indices, can.shape[1] + top.indices), dim=1)
    anchors = top.indices.gather(1, order)
    valid = top.values.gather(1, order) >= 0
    return anchors, valid


def block_mask(anchors: torch.Tensor, attention: torch.Tensor, block_size: int) -> torch.Tensor:
    """Training attention ``[B, 1, A*bs, L + A*bs]`` (True = attend): block ``j`` sees the context rows of
    positions before its anchor (real tokens only) and every position of its own block."""
    B, A = anchors.shape
    L = attention.shape[1]
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, Q]
    ctx = (torch.arange(L, device=anchors.device)[None, None, :] < q_anchor[:, :, None]) & attention.bool()[:, None, :]
    blk = torch.arange(A * block_size, device=anchors.device) // block_size
    own = (blk[:, None] == blk[None, :]).expand(B, -1, -1)
    return torch.cat([ctx, own], dim=2)[:, None]


def loss_fn(
    head: nn.Module, batch: TrainBatch, feats: TargetFeatures, cfg: DFlashConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Block loss; see the module docstring. Metrics: per slot ``k`` the loss and top-1 agreement with the
    target (``acc_top1_pos{k}``), and ``accept_len``: the mean over blocks of 1 + the run of agreeing slots (the
    tokens a greedy verification of the block would commit, where every slot is counted)."""
    core = extract_model_from_parallel(head)
    ids, am = batch.input_ids, batch.attention_mask.bool()
    written = batch.loss_mask.bool() & am
    B, L = ids.shape
    bs = core.block_size
    W = bs - 1
    dev = ids.device
    parts = [feats.layers[i] for i in core.layer_ids]
    if cfg.feature_noise > 0 and head.training:
        parts = [noise_features(x, cfg.feature_noise) for x in parts]
    rows = core.fuse(torch.cat(parts, dim=-1))  # [B, L, H]
    # slot k of an anchor at a counts if x[a + k] is in the row and target-written
    padded = torch.cat([written, torch.zeros(B, bs, dtype=torch.bool, device=dev)], 1)
    slot_ok = torch.stack([padded[:, k : k + L] for k in range(1, bs)], dim=-1)  # [B, L, W]
    can = written & slot_ok.any(-1)
    can[:, 0] = False  # an anchor needs a context row before it
    metrics: dict[str, torch.Tensor] = {}
    if not bool(can.any()):  # every process must report the same metric keys
        for k in range(1, bs):
            metrics[f"acc_top1_pos{k}"] = torch.tensor(0.0)
            metrics[f"loss_pos{k}"] = torch.tensor(0.0)
        metrics.update(tokens=torch.tensor(0.0), accept_len=torch.tensor(0.0))
        return rows.sum() * 0.0, metrics
    anchors, valid = choose_anchors(can, cfg.anchors_per_row)  # [B, A]
    A = anchors.shape[1]
    block = core.block_ids(ids.gather(1, anchors).reshape(-1)).view(B, A * bs)
    pos = (anchors[:, :, None] + torch.arange(bs, device=dev)).view(B, A * bs)
    ctx = core.context_kv(rows, torch.arange(L, device=dev).expand(B, L))
    h = core.hidden(block, pos, ctx, block_mask(anchors, am, bs)).view(B, A, bs, -1)[:, :, 1:]  # [B, A, W, H]
    counted = valid[:, :, None] & slot_ok.gather(1, anchors[:, :, None].expand(-1, -1, W))  # [B, A, W]
    teacher_pos = anchors[:, :, None] + torch.arange(W, device=dev)  # slot k's teacher is at a + k - 1
    target_ids = core.target_ids().to(dev)
    n_all = int(counted.sum())
    # A position is the teacher of up to W (anchor, slot) pairs: project each one onto the draft vocabulary once.
    flat = (torch.arange(B, device=dev)[:, None, None] * L + teacher_pos)[counted]
    uniq, row_of = torch.unique(flat, return_inverse=True)
    slot_row = torch.full((B, A, W), -1, dtype=torch.long, device=dev)
    slot_row[counted] = row_of
    with torch.no_grad(), torch.autocast(dev.type, enabled=False):
        x_last = feats.last.reshape(B * L, -1)[uniq]
        teachers = torch.softmax(lm_head_rows(feats.lm_head, x_last, target_ids) / cfg.teacher_temperature, -1)
    total = torch.zeros((), device=dev)
    agree = torch.zeros(B, A, W, dtype=torch.bool, device=dev)
    for k in range(W):
        sel = counted[:, :, k]
        n = int(sel.sum())
        if n == 0:
            metrics[f"acc_top1_pos{k + 1}"] = torch.tensor(0.0)
            metrics[f"loss_pos{k + 1}"] = torch.tensor(0.0)
            continue
        teacher = teachers[slot_row[:, :, k][sel]]
        ce_sum, d_top = soft_cross_entropy(core.draft_logits(h[:, :, k][sel]), teacher)
        total = total + math.exp(-k / cfg.loss_gamma) * ce_sum / n_all
        with torch.no_grad():
            hit = d_top == teacher.argmax(-1)
            agree[:, :, k][sel] = hit
        metrics[f"acc_top1_pos{k + 1}"] = hit.float().mean()
        metrics[f"loss_pos{k + 1}"] = (ce_sum / n).detach()
    with torch.no_grad():
        run = torch.cumprod(agree.long(), dim=-1).sum(-1).float()  # [B, A]
        metrics["accept_len"] = (run[valid] + 1).mean()
    metrics["tokens"] = counted[:, :, 0].sum().float()
    return total, metrics


def save(head: nn.Module, directory: str, cfg: DFlashConfig, target: Any = None) -> None:
    """``model.safetensors`` (speculators' DFlash names, without the frozen embedding) + ``config.json``."""
    core = extract_model_from_parallel(head)
    assert isinstance(core, DFlashHead)
    conf = {
        **core.config.to_dict(),
        "num_hidden_layers": len(core.layers),
        "architectures": ["DFlashDraftModel"],
        "block_size": core.block_size,
        "draft_vocab_size": core.draft_vocab_size,
        "mask_token_id": core.mask_token_id,
        "target_layer_ids": core.layer_ids,
        "tie_word_embeddings": False,
    }
    extra = {"d2t_hash": vocab_hash(core.d2t.cpu()), "layer_ids": core.layer_ids, "mask_token_id": core.mask_token_id}
    save_head(core, directory, cfg, conf, extra, skip=("embed_tokens.",))


def load(directory: str, target: Any, cfg: DFlashConfig | None = None) -> DFlashHead:
    saved = read_head(directory, DFlashConfig, target.config, "DFlash draft")
    path, meta, state, tcfg = saved.path, saved.meta, saved.state, target.config
    if "mask_token" not in state:
        raise ValueError(f"DFlash checkpoint {path} lacks mask_token")
    vd = check_saved_vocab(state, meta, saved.recorded.get("d2t_hash"), tcfg.vocab_size, f"DFlash checkpoint {path}")
    layers = sorted({int(k.split(".")[1]) for k in state if k.startswith("layers.")})
    head = DFlashHead(
        tcfg,
        saved.recorded.get("layer_ids") or layer_ids_for(saved.cfg.layer_ids, tcfg),
        len(layers),
        int(meta.get("block_size", saved.cfg.block_size)),
        vd,
        int(state["mask_token"][0]),
    )
    state["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().cpu().float()
    load_state(head, state, f"DFlash checkpoint {path}")
    return head.to(next(target.parameters()).dtype).eval()


def make_proposer(head: nn.Module, target: Any, cfg: DFlashConfig) -> DFlashProposer:
    assert isinstance(head, DFlashHead)
    layer_ids = head.layer_ids
    feature_fn = fused_features(layer_ids, target.config.num_hidden_layers)
    return DFlashProposer(head, cfg, feature_fn=feature_fn, aux_hidden_layers=layer_ids)


def feature_layers(cfg: DFlashConfig, target_config: Any) -> list[int]:
    return sorted({*layer_ids_for(cfg.layer_ids, target_config), int(target_config.num_hidden_layers)})


SPEC = register(
    DrafterSpec(
        name="dflash",
        export_module="train.export.dflash",
        config_cls=DFlashConfig,
        build=build,
        loss=loss_fn,
        proposer=make_proposer,
        load=load,
        save=save,
        feature_layers=feature_layers,
        prepare=prepare,
    )
)
