"""EAGLE-3 feature head: fused low/middle/high target features, training-time test, a reduced draft vocabulary.

Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time Test" (2025).

The head reads three target layers (HF ``hidden_states`` indices ``layer_ids``; default ``(2, N//2, N-3)``,
the layers vLLM and ``speculators`` pick) concatenated, fuses them with ``fc: 3H -> H`` (no bias) and runs one
decoder layer whose attention input is ``[input_layernorm(embed(x[t+1])), hidden_norm(h[t])]`` (2H wide) with
``h[t]`` as the residual. Its output ``h'`` is fed back as the next step's feature (no ``fc`` then) and gives
draft logits over a reduced vocabulary: ``lm_head(norm(h'))`` ``[draft_vocab_size]``. ``d2t`` (``target_id =
draft_id + d2t[draft_id]``) and ``t2d`` (bool over the target vocabulary) map between the two; they are built
from the training data's token frequencies, saved with the checkpoint and checked (with a hash) on load.

Optional norms (speculators' trainer defaults; vLLM reads the same flags, all off = EAGLE-3 as published):
``norm_before_fc`` (an RMSNorm on the concatenated layers before ``fc``), ``norm_before_residual`` (the residual is
``hidden_norm(h[t])``), ``norm_output`` (``norm(h')`` is fed back and gives the logits).

Training-time test (TTT): the head is unrolled for ``ttt_steps`` steps. Step 0 sees the target's fused
features; step j sees its own outputs of step j-1 at the same entry, and the token ``x[t+1+j]`` (positions
shifted by j). Entry t of step j attends to step 0's keys at positions <= t (the committed context) and to
its own keys of steps 1..j (its own draft chain) -- exactly what it sees when drafting j tokens ahead at
inference. Loss of step j: cross-entropy against the target's next-token distribution restricted to the draft
vocabulary, at every target-written position (``loss_all_positions``, the default; off: only where the target's
top token is in the draft vocabulary), weighted ``ttt_decay ** j`` (SpecForge: 0.8). Only entries whose chain
reaches a target-written token are unrolled past step 0's keys and values (prompt positions are context only).

Parameter names follow SGLang's EAGLE-3 layout (``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``,
``t2d``); the token embedding is a frozen copy of the target's and is not saved.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from accelerate.utils import extract_model_from_parallel
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from data.config import Bound, Choice, Choices, ConfigError, above, at_least, between
from eval.config import DRAFT_SHAPE_BOUNDS, Decode
from eval.proposers.feature_head import FeatureHeadProposer
from eval.shared_past import SharedPast
from train.drafters.layers import (
    KV,
    DraftAttention,
    acceptance_loss,
    check_window,
    draft_layer_config,
    gather_rows,
    lm_head_rows,
    noise_features,
    soft_cross_entropy,
)
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

logger = logging.getLogger(__name__)


class DraftLoss(Choice):
    """What a draft position's loss measures against the target's distribution."""

    kl = "kl"
    tv = "tv"
    lk = "lk"
    lk_hybrid = "lk_hybrid"


@dataclass
class Eagle3Config(Choices):
    """EAGLE-3 head and its decoding settings."""

    config_key: ClassVar[str] = "drafter"
    bounds: ClassVar[dict[str, Bound]] = {
        "layer_ids": at_least(0),
        "draft_vocab_size": at_least(0, "0: the full vocabulary"),
        "ttt_steps": at_least(1),
        "ttt_decay": above(0),
        **{k: at_least(0) for k in ("feature_noise", "feature_loss", "ttt_align_topk")},
        "dropout": between(0, 1, hi_open=True),
        "teacher_temperature": above(0),
        "lk_eta": above(0),
        "sliding_window": at_least(2, "or null: full attention"),
        **DRAFT_SHAPE_BOUNDS,
    }

    absent_means: ClassVar[dict[str, Any]] = {
        **dict.fromkeys(("norm_before_fc", "norm_before_residual", "norm_output", "loss_on_prompt"), False),
        "feature_noise": 0.0,
    }
    """What a saved head's config.json that lacks a key was trained with (heads saved before the key existed)."""

    name: str = "eagle3"
    layer_ids: list[int] | None = None
    """Target layers fused by ``fc`` (HF ``hidden_states`` indices: 0 = embeddings, i = output of decoder layer
    i); None = ``(2, N//2, N-3)`` for an N-layer target, as vLLM and speculators choose."""
    draft_vocab_size: int = 8192
    """Size of the draft vocabulary (the most frequent target-written tokens of the training data);
    0 or >= the target's vocabulary = the full vocabulary."""
    ttt_steps: int = 3
    """Training-time-test unroll length (SpecForge trains with 7; the CPU recipes use fewer)."""
    ttt_decay: float = 0.8
    """Loss weight of TTT step j is ``ttt_decay ** j``."""
    loss_all_positions: bool = True
    """Also train where the target's top token lies outside the draft vocabulary, against the target's
    distribution renormalised over the draft vocabulary (speculators' rule; held-out tau within 0.001 of the
    other rule at the quickstart budget, BENCHMARKS), and then the target's LM head is only projected onto the
    draft vocabulary's rows; off = SpecForge's rule, only where the draft vocabulary can hold the target's top
    token (needs the full projection to know)."""
    loss_on_prompt: bool = True
    """Also train at prompt positions, against the target's distribution after each prompt token (its features are
    computed anyway): more supervised positions per step, at the cost of unrolling every entry; off = only where
    the next token is target-written (EAGLE, SpecForge, speculators). On: it won at equal steps (BENCHMARKS)."""
    feature_noise: float = 0.3
    """Training only: Gaussian noise on each fused target layer, its std this fraction of the token's RMS in that
    layer (EAGLE trains its feature head on noised target features, uniform +-0.1); 0 = none."""
    dropout: float = 0.0
    """Training only: dropout on the draft layer's attention and MLP outputs (before each residual add); 0 = none
    (EAGLE, SpecForge and speculators train without it)."""
    teacher_temperature: float = 1.0
    """Training only: the target's distribution the loss matches is ``softmax(logits / teacher_temperature)``; below
    1 it is sharpened towards the target's top token (what greedy verification accepts), 1 = the distribution
    itself (what lossless sampling accepts)."""
    loss: DraftLoss = DraftLoss.kl
    """Training only: kl (the soft cross-entropy against the target's distribution, EAGLE's) | tv (one minus the
    overlap sum_v min(p, q): what lossless sampling accepts) | lk (-log of the overlap) | lk_hybrid (KL while the
    overlap is low, TV as it grows: arXiv 2602.23881). For tv / lk / lk_hybrid both distributions are read at
    ``teacher_temperature`` (set it to the serving temperature to train for acceptance there)."""
    lk_eta: float = 3.0
    """loss=lk_hybrid: the KL weight is exp(-lk_eta * overlap)."""
    feature_loss: float = 0.0
    """Training only: weight of an EAGLE-1-style SmoothL1 regression, at every TTT step's counted entries, of the
    vector the draft LM head reads onto the one the target's LM head reads at the same position (its last hidden
    state): a pull towards the target's own representation, which the draft LM head starts from; 0 = none
    (EAGLE-3 as published, which dropped EAGLE-1's feature loss)."""
    ttt_align_topk: int = 0
    """Training only: TTT step j >= 1 counts an entry only if every earlier step counted it and every token it was
    fed at steps < j was among the draft's top ``ttt_align_topk`` at that step (GRIFFIN's token-alignable
    training: a state that decoding never reaches, because an earlier draft missed, costs no capacity);
    0 = every entry."""
    init_norm_from_target: bool = False
    """Start the head's final norm (``norm``, in front of the draft LM head) at the target's final norm weights
    instead of ones: the draft LM head starts at the target's rows, which expect features scaled by that norm."""
    init_layer_from_target: int | None = None
    """Start the draft decoder layer from one of the target's decoder layers (0-based; negative counts from the end,
    -1 = the last) instead of a random init: its MLP, post-attention norm and ``o_proj``, its input norm as
    ``hidden_norm``, and its q/k/v projections as the feature half of the 2H-wide q/k/v (the embedding half keeps
    its random init). None = random (EAGLE-3 as published)."""
    freeze_lm_head: bool = False
    """Keep the draft LM head at the target's rows for the draft vocabulary (speculators' default) instead of
    training it: about half the trainable parameters fewer."""
    # The three norms are on by default; a head saved before they existed (its config.json lacks them) loads with
    # them off, the math it was trained with (absent_means).
    norm_before_fc: bool = True
    """An RMSNorm (``input_norm``, k*H wide) on the concatenated target layers before ``fc`` (speculators'
    trainer default for EAGLE-3; vLLM reads the same flag)."""
    norm_before_residual: bool = True
    """The residual of the draft layer is ``hidden_norm(h)`` instead of ``h`` (speculators' trainer default)."""
    norm_output: bool = True
    """Feed ``norm(h')`` back as the next step's feature (and take logits from it) instead of the pre-norm
    ``h'`` (speculators' trainer default: keeps the feature's magnitude from drifting over the steps)."""
    sliding_window: int | None = None
    """The draft layer attends only to the last ``sliding_window`` positions (itself included), in training, in
    every decoder and in the exports (speculators' ``transformer_layer_config.sliding_window`` with a
    ``sliding_attention`` layer type, which vLLM serves); None = the whole context. On rows of at most
    ``sliding_window - ttt_steps + 2`` tokens training is exactly as without it: the window then only keeps the
    draft's attention within the distances it was trained on when contexts grow longer (BENCHMARKS). Must be longer
    than any draft (``ttt_steps``, ``chain_k``, ``tree_depth``)."""
    decode: Decode = Decode.tree
    """How the eval decoder drafts with this head: tree (EAGLE-2 dynamic tree) | chain."""
    chain_k: int = 5
    tree_depth: int = 5
    tree_top_k: int = 4
    tree_total_tokens: int = 16


def resolve_layer_ids(cfg: Eagle3Config, target_config: Any) -> list[int]:
    return layer_ids_for(cfg.layer_ids, target_config)


def draft_vocab(cfg: Eagle3Config, target_config: Any) -> int:
    v = int(target_config.vocab_size)
    return v if cfg.draft_vocab_size <= 0 or cfg.draft_vocab_size >= v else int(cfg.draft_vocab_size)


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention over [norm(embedding), norm(feature)] with the feature (or, with
    ``norm_before_residual``, the normed feature) as residual."""

    def __init__(self, config: Any, norm_before_residual: bool = False) -> None:
        super().__init__()
        self.norm_before_residual = norm_before_residual
        self.dropout = 0.0
        """Training only: dropout on the attention and MLP outputs (set by ``build`` from the config)."""
        hidden = config.hidden_size
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=eps)
        self.self_attn = DraftAttention(config, 2 * hidden)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        emb: torch.Tensor,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past: KV | SharedPast | None = None,
        mask: torch.Tensor | None = None,
        queries: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, KV]:
        """``queries`` (``[B, Q]``): every position gives keys/values, only these an output; ``positions``: the T
        positions, for a sliding window (see DraftAttention)."""
        hn = self.hidden_norm(h)
        if self.norm_before_residual:
            h = hn
        x = torch.cat([self.input_layernorm(emb), hn], dim=-1)
        a, kv = self.self_attn(x, cos, sin, past, mask, queries, positions)
        if queries is not None:
            h = gather_rows(h, queries)
        p = self.dropout if self.training else 0.0
        h = h + (nn.functional.dropout(a, p) if p else a)
        m = self.mlp(self.post_attention_layernorm(h))
        h = h + (nn.functional.dropout(m, p) if p else m)
        return h, kv


NORM_FLAGS = ("norm_before_fc", "norm_before_residual", "norm_output")
"""The optional norms of :class:`Eagle3Head` (speculators' and vLLM's names; all off = EAGLE-3 as published)."""


def norm_flags(cfg: Any) -> dict[str, bool]:
    """The head's norm flags from a drafter config (or any object / dict carrying them; absent = off)."""
    get = cfg.get if isinstance(cfg, dict) else lambda k, d: getattr(cfg, k, d)
    return {k: bool(get(k, False)) for k in NORM_FLAGS}


class Eagle3Head(DraftVocab, nn.Module):
    def __init__(
        self,
        target_config: Any,
        layer_ids: list[int],
        draft_vocab_size: int,
        norms: dict[str, bool] | None = None,
        window: int | None = None,
    ) -> None:
        super().__init__()
        config = draft_layer_config(target_config)  # a Llama layer of the target's dimensions, any architecture
        H, V = config.hidden_size, config.vocab_size
        num_aux = len(layer_ids)
        self.config = config
        self.layer_ids = [int(i) for i in layer_ids]
        """The target layers (HF ``hidden_states`` indices) whose concatenation ``fc`` fuses, in order."""
        self.hidden_size = H
        self.norms = norm_flags(norms or {})
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.embed_tokens = nn.Embedding(V, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.input_norm = LlamaRMSNorm(num_aux * H, eps=eps) if self.norms["norm_before_fc"] else None
        self.fc = nn.Linear(num_aux * H, H, bias=False)
        self.midlayer = Eagle3Layer(config, norm_before_residual=self.norms["norm_before_residual"])
        self.norm = LlamaRMSNorm(H, eps=getattr(config, "rms_norm_eps", 1e-6))
        self.lm_head = nn.Linear(H, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[:draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.rotary = LlamaRotaryEmbedding(config)
        self.midlayer.self_attn.window = None if window is None else int(window)

    def forward(
        self,
        features: torch.Tensor,
        next_ids: torch.Tensor,
        position_ids: torch.Tensor,
        past: list[KV] | None = None,
        mask: torch.Tensor | None = None,
        queries: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[KV]]:
        """features: ``[B, T, k*H]`` fused target layers, or ``[B, T, H]`` the head's own earlier outputs;
        next_ids: ``[B, T]`` the token after each feature's position; returns ``(h' [B, T, H], [kv])``
        (``[B, Q, H]`` for ``queries`` ``[B, Q]``: keys/values from all T positions, outputs only for those)."""
        if features.shape[-1] != self.hidden_size:  # fused target layers
            h = self.fc(features if self.input_norm is None else self.input_norm(features))
        else:
            h = features
        emb = self.embed_tokens(next_ids).to(h.dtype)
        cos, sin = self.rotary(h, position_ids)
        out, kv = self.midlayer(emb, h, cos, sin, None if past is None else past[0], mask, queries, position_ids)
        if self.norms["norm_output"]:
            out = self.norm(out)
        return out, [kv]

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary, ``[..., draft_vocab_size]`` (``h`` is already normed with
        ``norm_output``)."""
        return self.lm_head(h if self.norms["norm_output"] else self.norm(h))


def target_decoder(target: Any) -> Any:
    """The target's decoder stack (``model.model`` of a Llama-style causal LM), or None."""
    return target.get_decoder() if hasattr(target, "get_decoder") else getattr(target, "model", None)


def final_norm(target: Any) -> nn.Module:
    """The target's final norm (the module in front of its LM head), for a Llama-style decoder."""
    norm = getattr(target_decoder(target), "norm", None)
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.shape != (target.config.hidden_size,):
        raise ConfigError(
            "drafter.init_norm_from_target=true needs a Llama-style target with a final norm (model.norm) of the "
            f"hidden size; {type(target).__name__} has none"
        )
    return norm


def init_layer_from_target(head: Eagle3Head, target: Any, index: int) -> None:
    """Copy target decoder layer ``index`` into the head's draft layer (see ``Eagle3Config.init_layer_from_target``)."""
    layers = getattr(target_decoder(target), "layers", None)
    n = len(layers) if layers is not None else 0
    if not -n <= index < n:
        raise ConfigError(f"drafter.init_layer_from_target={index}: the target has {n} decoder layers")
    src, dst = layers[index], head.midlayer
    H = head.hidden_size

    def part(name: str) -> nn.Module:
        mod = src.get_submodule(name) if name in dict(src.named_modules()) else None
        if not isinstance(getattr(mod, "weight", None), torch.Tensor):
            raise ConfigError(
                f"drafter.init_layer_from_target: layer {index} of {type(target).__name__} has no {name} (it is not a "
                "dense Llama-style layer: an MoE, other names or a fused projection); leave the option unset"
            )
        return mod

    pairs = [
        (dst.mlp.gate_proj, part("mlp.gate_proj")),
        (dst.mlp.up_proj, part("mlp.up_proj")),
        (dst.mlp.down_proj, part("mlp.down_proj")),
        (dst.post_attention_layernorm, part("post_attention_layernorm")),
        (dst.hidden_norm, part("input_layernorm")),
        (dst.self_attn.o_proj, part("self_attn.o_proj")),
    ]
    with torch.no_grad():
        for d, s in pairs:
            if d.weight.shape != s.weight.shape:
                raise ConfigError(
                    f"drafter.init_layer_from_target: target layer {index} does not match the draft layer "
                    f"({tuple(s.weight.shape)} vs {tuple(d.weight.shape)})"
                )
            d.weight.copy_(s.weight)
        for name in ("q_proj", "k_proj", "v_proj"):
            d, s = getattr(dst.self_attn, name), part(f"self_attn.{name}")
            if d.weight.shape != (s.weight.shape[0], 2 * H) or s.weight.shape[1] != H:
                raise ConfigError(f"drafter.init_layer_from_target: target layer {index}'s {name} does not fit")
            d.weight[:, H:].copy_(s.weight)
            if d.bias is not None and s.bias is not None:
                d.bias.copy_(s.bias)


def build(cfg: Eagle3Config, target: Any) -> Eagle3Head:
    tcfg = target.config
    layer_ids = resolve_layer_ids(cfg, tcfg)
    if cfg.ttt_steps < 1:
        raise ConfigError(f"drafter.ttt_steps={cfg.ttt_steps} must be >= 1")
    if not cfg.teacher_temperature > 0:
        raise ConfigError(f"drafter.teacher_temperature={cfg.teacher_temperature} must be > 0")
    if not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(f"drafter.dropout={cfg.dropout} must be in [0, 1)")
    if not cfg.feature_loss >= 0:
        raise ConfigError(f"drafter.feature_loss={cfg.feature_loss} must be >= 0")
    check_window(cfg.sliding_window, cfg.ttt_steps, "drafter.sliding_window")
    vd = draft_vocab(cfg, tcfg)
    head = Eagle3Head(tcfg, layer_ids, vd, norm_flags(cfg), cfg.sliding_window)
    head.midlayer.dropout = float(cfg.dropout)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[:vd])
        if cfg.init_norm_from_target:
            head.norm.weight.copy_(final_norm(target).weight)
    if cfg.init_layer_from_target is not None:
        init_layer_from_target(head, target, int(cfg.init_layer_from_target))
    head.lm_head.weight.requires_grad_(not cfg.freeze_lm_head)
    return head.to(next(target.parameters()).dtype)


def prepare(head: nn.Module, rows: list[Any], cfg: Eagle3Config, target: Any) -> dict[str, Any]:
    """Build d2t/t2d from the training rows and initialise the draft LM head from the target's LM head rows
    of the chosen draft vocabulary."""
    assert isinstance(head, Eagle3Head)
    return init_draft_vocab(head, rows, target)


COVERAGE_SAMPLE = 16
"""Positions per batch on which ``vocab_coverage`` is measured when ``loss_all_positions`` needs no full
projection."""


def ttt_mask(T: int, step: int, device: torch.device) -> torch.Tensor:
    """Attention of step ``step``'s T entries over the keys of steps 0..step: ``[T, (step + 1) * T]`` bool.

    Step 0's keys causally (the committed context), then every later step's key at the same entry only."""
    blocks = [torch.ones(T, T, dtype=torch.bool, device=device).tril()]
    blocks += [torch.eye(T, dtype=torch.bool, device=device)] * step
    return torch.cat(blocks, dim=1)


def loss_fn(
    head: nn.Module, batch: TrainBatch, feats: TargetFeatures, cfg: Eagle3Config, needed_only: bool = True
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TTT loss; entry t of step j predicts ``x[t+j+2]`` from the token ``x[t+j+1]``.

    ``needed_only``: an entry whose chain has no counted position at any step (a prompt position: the loss
    covers target-written tokens only) still gives step 0's keys and values, the context of every later entry,
    but no queries, MLP or later steps; the loss and gradients are those of the full unroll (``False``, kept as
    the reference the tests compare with) up to float rounding, at a fraction of the arithmetic when prompts
    are long."""
    core = extract_model_from_parallel(head)
    layer_ids = core.layer_ids
    ids, lm, am = batch.input_ids, batch.loss_mask, batch.attention_mask
    B, L = ids.shape
    T = L - 1
    if T < 2:
        raise ValueError("EAGLE-3 training rows need at least 3 tokens")
    parts = [feats.layers[i][:, :T] for i in layer_ids]
    if cfg.feature_noise > 0 and head.training:
        parts = [noise_features(x, cfg.feature_noise) for x in parts]
    fused = torch.cat(parts, dim=-1)
    dev = fused.device
    target_ids = core.target_ids().to(dev)
    # The target's distribution over the draft vocabulary at every position p that predicts a target-written
    # token x[p+1]; the LM head runs only on those rows.
    # position p = 1..L-2 predicts x[p+1]
    need = (am[:, 2:] if cfg.loss_on_prompt else lm[:, 2:] * am[:, 2:]).bool()
    rows = torch.nonzero(need)  # (b, p-1)
    # the teacher rows, one per position that needs one, and which row each (b, position) has (-1: none)
    t_rows = torch.zeros(0, target_ids.numel(), device=dev)
    t_last = torch.zeros(0, core.hidden_size, device=dev)  # feature_loss: the target's last hidden state, per row
    t_idx = torch.full((B, L + cfg.ttt_steps), -1, dtype=torch.long, device=dev)
    t_idx[rows[:, 0], rows[:, 1] + 1] = torch.arange(rows.shape[0], device=dev)
    in_vocab = torch.zeros(B, L, dtype=torch.bool, device=dev)
    coverage: torch.Tensor | None = None
    tt = float(cfg.teacher_temperature)
    if rows.numel():
        # the teacher in the features' own precision, also under a bf16 autocast
        with torch.no_grad(), torch.autocast(dev.type, enabled=False):
            x_last = feats.last[rows[:, 0], rows[:, 1] + 1]
            if cfg.feature_loss > 0:
                t_last = x_last.float()
            if cfg.loss_all_positions:
                # Only the draft vocabulary's rows of the target's LM head are needed for the loss (8,192 of
                # 49,152 for the default: the full projection was ~a fifth of a training step's arithmetic).
                # Whether the target's top token is in the draft vocabulary is only a metric then, estimated
                # from the first COVERAGE_SAMPLE positions of the batch.
                t_rows = torch.softmax(lm_head_rows(feats.lm_head, x_last, target_ids) / tt, -1)
                top = feats.lm_head(x_last[:COVERAGE_SAMPLE]).argmax(-1)
                coverage = core.t2d.to(dev)[top].float().mean()
            else:
                logits = feats.lm_head(x_last).float()
                in_vocab[rows[:, 0], rows[:, 1] + 1] = core.t2d.to(dev)[logits.argmax(-1)]
                t_rows = torch.softmax(logits[:, target_ids] / tt, -1)
    t_top = t_rows.argmax(-1) if t_rows.shape[0] else torch.zeros(0, dtype=torch.long, device=dev)
    pad = torch.full((B, cfg.ttt_steps + 1), int(ids[0, -1]), dtype=ids.dtype, device=dev)
    ids_ext = torch.cat([ids, pad], dim=1)
    counted = need if cfg.loss_all_positions else need & in_vocab[:, 1:-1]
    valid = torch.cat([counted, torch.zeros(B, cfg.ttt_steps + 1, dtype=torch.bool, device=dev)], 1)
    pos = torch.arange(T, device=dev).expand(B, -1)
    sel: torch.Tensor | None = None  # the entries that are unrolled, [B, S] (None: all T)
    if needed_only:
        needed = valid[:, :T].clone()
        for j in range(1, cfg.ttt_steps):
            needed |= valid[:, j : j + T]
        S = max(int(needed.sum(1).max()), 1)
        # needed entries first, in position order; the rest of the S columns are unneeded entries, whose
        # positions never count (valid is False wherever they land)
        sel = torch.argsort((~needed).to(torch.int8), dim=1, stable=True)[:, :S]
        context = pos[:, None, :] <= sel[:, :, None]  # step 0's keys an entry sees: [B, S, T]
        chain = torch.eye(S, dtype=torch.bool, device=dev).expand(B, S, S)
    h: torch.Tensor = fused
    past: list[KV] | None = None
    total = torch.zeros((), device=dev)
    metrics: dict[str, torch.Tensor] = {}
    alive: torch.Tensor | None = None  # ttt_align_topk: entries whose fed tokens were all in the draft's top-k
    for j in range(cfg.ttt_steps):
        step_ids = ids_ext[:, 1 + j : 1 + j + T]
        keep = valid[:, j : j + T]  # entry t counts if x[t+j+2] is target-written and the target's top is drafted
        idx_j = t_idx[:, 1 + j : 1 + j + T]
        if sel is None:
            mask = ttt_mask(T, j, dev)[None, None]
            h, kv = head(h, step_ids, pos + j, past=past, mask=mask)
        else:
            mask = torch.cat([context] + [chain] * j, dim=2)[:, None]
            if j == 0:  # keys/values from every position, outputs for the selected entries
                h, kv = head(h, step_ids, pos, past=past, mask=mask, queries=sel)
            else:
                h, kv = head(h, gather_rows(step_ids, sel), sel + j, past=past, mask=mask)
            keep, idx_j = gather_rows(keep, sel), gather_rows(idx_j, sel)
        past = kv  # the attention returns the earlier steps' keys/values followed by this step's
        if alive is not None:
            keep = keep & alive
        n = int(keep.sum())
        if n == 0:  # every process must report the same metric keys (they are all-reduced as one vector)
            metrics[f"acc_top1_pos{j + 1}"] = torch.tensor(0.0)
            metrics[f"loss_step{j + 1}"] = torch.tensor(0.0)
            if cfg.feature_loss > 0:
                metrics[f"feature_loss_step{j + 1}"] = torch.tensor(0.0)
            if cfg.ttt_align_topk > 0:
                alive = torch.zeros_like(keep)
            continue
        d_logits = core.draft_logits(h[keep])
        tp_ix = idx_j[keep]
        if cfg.ttt_align_topk > 0 and j + 1 < cfg.ttt_steps:
            with torch.no_grad():  # the token fed at step j+1 is this step's label, x[t+j+2]
                fed = ids_ext[:, 2 + j : 2 + j + T]
                fed = fed if sel is None else gather_rows(fed, sel)
                k = min(cfg.ttt_align_topk, d_logits.shape[-1])
                top = target_ids[d_logits.topk(k, dim=-1).indices]
                alive = torch.zeros_like(keep)
                alive[keep] = (top == fed[keep][:, None]).any(-1)
        if cfg.loss == "kl":  # cross-entropy against the teacher's rows, fused (the vocabulary-wide passes were most
            # of a CPU step)
            ce_sum, d_top = soft_cross_entropy(d_logits, t_rows[tp_ix])
        else:  # the acceptance itself (TV), its log (LK) or a blend
            ce_sum, d_top = acceptance_loss(d_logits, t_rows[tp_ix], str(cfg.loss), tt, cfg.lk_eta)
        step_loss = ce_sum / n
        total = total + cfg.ttt_decay**j * step_loss
        if cfg.feature_loss > 0:
            read = h[keep] if core.norms["norm_output"] else core.norm(h[keep])
            reg = nn.functional.smooth_l1_loss(read.float(), t_last[tp_ix], reduction="none").mean(-1).sum() / n
            total = total + cfg.ttt_decay**j * cfg.feature_loss * reg
            metrics[f"feature_loss_step{j + 1}"] = reg.detach()
        with torch.no_grad():
            acc = (d_top == t_top[tp_ix]).float().mean()
        metrics[f"acc_top1_pos{j + 1}"] = acc
        metrics[f"loss_step{j + 1}"] = step_loss.detach()
        if j == 0:
            metrics["tokens"] = torch.tensor(float(n))
    metrics.setdefault("tokens", torch.tensor(0.0))
    with torch.no_grad():
        if coverage is not None:
            metrics["vocab_coverage"] = coverage
        else:
            metrics["vocab_coverage"] = in_vocab[:, 2:][need].float().mean() if rows.numel() else torch.tensor(1.0)
    return total, metrics


def save(head: nn.Module, directory: str, cfg: Eagle3Config, target: Any = None) -> None:
    """``model.safetensors`` (SGLang EAGLE-3 names, without the frozen embedding) + ``config.json`` (with the
    layer ids and the vocabulary map's hash)."""
    core = extract_model_from_parallel(head)
    assert isinstance(core, Eagle3Head)
    conf = {
        **core.config.to_dict(),
        "num_hidden_layers": 1,
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": core.draft_vocab_size,
        "target_hidden_size": core.config.hidden_size,
        "eagle_aux_hidden_state_layer_ids": core.layer_ids,
        "tie_word_embeddings": False,
    }
    extra = {"d2t_hash": vocab_hash(core.d2t.cpu()), "layer_ids": core.layer_ids}
    save_head(core, directory, cfg, conf, extra, skip=("embed_tokens.",))


def load(directory: str, target: Any, cfg: Eagle3Config | None = None) -> Eagle3Head:
    saved = read_head(directory, Eagle3Config, target.config, "EAGLE-3 head")
    path, meta, state, tcfg = saved.path, saved.meta, saved.state, target.config
    vd = check_saved_vocab(state, meta, saved.recorded.get("d2t_hash"), tcfg.vocab_size, f"EAGLE-3 checkpoint {path}")
    layer_ids = saved.recorded.get("layer_ids") or resolve_layer_ids(saved.cfg, tcfg)
    window = saved.cfg.sliding_window if cfg is None else cfg.sliding_window
    head = Eagle3Head(tcfg, layer_ids, vd, norm_flags(saved.cfg), window)
    state["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().cpu().float()
    load_state(head, state, f"EAGLE-3 checkpoint {path}")
    return head.to(next(target.parameters()).dtype).eval()


def make_proposer(head: nn.Module, target: Any, cfg: Eagle3Config) -> Any:
    assert isinstance(head, Eagle3Head)
    window = head.midlayer.self_attn.window
    check_window(window, max(int(cfg.chain_k), int(cfg.tree_depth)), "drafter.sliding_window")
    layer_ids = head.layer_ids
    feature_fn = fused_features(layer_ids, target.config.num_hidden_layers)
    return FeatureHeadProposer(
        head,
        head.full_logits,
        cfg,
        feature_fn=feature_fn,
        aux_hidden_layers=layer_ids,
        draft_vocab=(head.draft_logits, head.target_ids()),
    )


def feature_layers(cfg: Eagle3Config, target_config: Any) -> list[int]:
    return sorted({*resolve_layer_ids(cfg, target_config), int(target_config.num_hidden_layers)})


SPEC = register(
    DrafterSpec(
        name="eagle3",
        export_module="train.export.eagle3",
        config_cls=Eagle3Config,
        build=build,
        loss=loss_fn,
        proposer=make_proposer,
        load=load,
        save=save,
        feature_layers=feature_layers,
        prepare=prepare,
    )
)
