"""EAGLE feature head (EAGLE-1 weights; decoded as EAGLE-2 with dynamic trees, or as a chain).

Li et al., "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty" (ICML 2024) and
"EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees" (EMNLP 2024).

The head predicts the target's next *feature* (its final hidden state, the LM head's input) from the
current feature and the embedding of the token that follows it::

    f_hat[t+1] = layer( fc([embed(x[t+1]), f[t]]) )        fc: 2H -> H (with bias)
    draft logits[t+1] = target.lm_head(f_hat[t+1])         predicts x[t+2]

Loss (on target-written tokens, the synth loss mask; with ``loss_on_prompt`` at every real position):
``w_reg * SmoothL1(f_hat, f) + w_ce * CE(lm_head(f_hat), softmax(lm_head(f)))``. With ``feature_noise`` the input
features (not the regression targets) are noised in training, as EAGLE trains its head. Drafting feeds the head
its own predicted features.
Decoding with any of its trees is exact (lossless): the target verifies every draft token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from accelerate.utils import extract_model_from_parallel
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from data.config import Bound, Choices, ConfigError, at_least
from data.target import output_head
from eval.config import DRAFT_SHAPE_BOUNDS, Decode
from eval.proposers.feature_head import FeatureHeadProposer
from train.drafters.eagle3 import target_decoder
from train.drafters.layers import KV, DraftLayer, draft_layer_config, noise_features
from train.drafters.registry import DrafterSpec, TargetFeatures, TrainBatch, register
from train.drafters.saving import load_state, read_head, save_head

logger = logging.getLogger(__name__)


@dataclass
class EagleConfig(Choices):
    """EAGLE-1/2 head and its decoding settings."""

    config_key: ClassVar[str] = "drafter"
    bounds: ClassVar[dict[str, Bound]] = {
        "num_layers": at_least(1),
        **{k: at_least(0) for k in ("regression_weight", "ce_weight", "feature_noise")},
        **DRAFT_SHAPE_BOUNDS,
    }

    absent_means: ClassVar[dict[str, Any]] = {"loss_on_prompt": False, "feature_noise": 0.0}
    """What a saved head's config.json that lacks a key was trained with (heads saved before the key existed)."""

    name: str = "eagle"
    num_layers: int = 1
    regression_weight: float = 1.0
    """Weight of the SmoothL1 feature-regression loss (EAGLE: 1.0)."""
    ce_weight: float = 0.1
    """Weight of the cross-entropy against the target's next-token distribution (EAGLE: 0.1)."""
    loss_on_prompt: bool = True
    """Also train at prompt positions: the target's feature and next-token distribution after each prompt token
    are as much the target's as after its own tokens (they are computed anyway); off = only where the token two
    ahead is target-written (EAGLE's rule). On, with ``feature_noise=0.3``: together they won at equal steps
    (BENCHMARKS)."""
    feature_noise: float = 0.3
    """Training only: Gaussian noise on the input features f[t], its std this fraction of each token's RMS (EAGLE
    trains on noised features, uniform +-0.1; the regression target stays clean); 0 = none."""
    init_from_target: bool = False
    """Initialise the decoder layer from the target's last layer. Off by default: measured on SmolLM2, the
    copied layer blows up the head's outputs and top-1 accuracy stays near 0 (random init: 37% in 45 steps)."""
    decode: Decode = Decode.tree
    """How the eval decoder drafts with this head: tree (EAGLE-2 dynamic) | chain."""
    chain_k: int = 5
    tree_depth: int = 5
    tree_top_k: int = 4
    tree_total_tokens: int = 16


class EagleHead(nn.Module):
    """The EAGLE-1 head. Parameter names follow the EAGLE repository's checkpoints."""

    def __init__(self, target_config: Any, num_layers: int = 1) -> None:
        super().__init__()
        config = draft_layer_config(target_config)  # a Llama layer of the target's dimensions, any architecture
        H = config.hidden_size
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # a frozen copy of the target's embeddings
        self.fc = nn.Linear(2 * H, H, bias=True)
        self.layers = nn.ModuleList([DraftLayer(config, input_norm=i > 0) for i in range(num_layers)])
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(
        self,
        features: torch.Tensor,
        next_ids: torch.Tensor,
        position_ids: torch.Tensor,
        past: list[KV] | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[KV]]:
        """features: ``[B, T, H]`` f[t]; next_ids: ``[B, T]`` x[t+1]; position_ids: ``[B, T]`` (= t).

        Returns predicted features ``[B, T, H]`` (f_hat[t+1]) and each layer's keys/values.
        """
        emb = self.embed_tokens(next_ids).to(features.dtype)
        x = self.fc(torch.cat([emb, features], dim=-1))
        cos, sin = self.rotary(x, position_ids)
        kvs: list[KV] = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, cos, sin, None if past is None else past[i], mask)
            kvs.append(kv)
        return x, kvs


def build(cfg: EagleConfig, target: Any) -> EagleHead:
    tcfg = target.config
    if cfg.num_layers < 1:
        raise ConfigError(f"drafter.num_layers={cfg.num_layers} must be >= 1")
    head = EagleHead(tcfg, cfg.num_layers)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        if cfg.init_from_target:
            _init_from_last_layer(head, target)
    dtype = next(target.parameters()).dtype
    return head.to(dtype)


def _init_from_last_layer(head: EagleHead, target: Any) -> None:
    """Copy the target's last decoder layer into each draft layer, tensor by tensor where the names and shapes
    match (a Llama-like target); what does not match (an MoE's experts, QK norms, biases) keeps its random init,
    and the log says which."""
    layers = getattr(target_decoder(target), "layers", None)
    if not layers:
        logger.warning("drafter.init_from_target: %s has no decoder layers to copy; random init", type(target).__name__)
        return
    src = layers[-1].state_dict()
    for layer in head.layers:
        own = layer.state_dict()
        fits = {k: v for k, v in src.items() if k in own and own[k].shape == v.shape}
        layer.load_state_dict(fits, strict=False)
        left = sorted(k for k in own if k not in fits)
        if left:
            logger.warning(
                "drafter.init_from_target: %d of the draft layer's %d tensors have no match of the same name and "
                "shape in %s's last layer and keep their random init: %s",
                len(left),
                len(own),
                type(target).__name__,
                ", ".join(left),
            )


def loss_fn(
    head: nn.Module, batch: TrainBatch, feats: TargetFeatures, cfg: EagleConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """EAGLE loss over positions t = 0..L-3 (predicting f[t+1] and the token x[t+2])."""
    f = feats.last  # [B, L, H] post-norm features (the LM head's input)
    B, L, _ = f.shape
    ids = batch.input_ids
    pos = torch.arange(L - 1, device=ids.device).expand(B, -1)
    inp = f[:, :-1]
    if cfg.feature_noise > 0 and head.training:
        inp = noise_features(inp, cfg.feature_noise)
    pred, _ = head(inp, ids[:, 1:], pos)  # [B, L-1, H]: f_hat[1..L-1]
    pred, target_f = pred[:, :-1], f[:, 1:-1]  # drop the last position (its next token is unknown)
    am = batch.attention_mask[:, 2:]
    keep = (am if cfg.loss_on_prompt else batch.loss_mask[:, 2:] * am).bool()  # x[t+2] real (target-written)
    pred, target_f = pred[keep], target_f[keep]  # [N, H]: the LM head only runs where the loss counts
    n = max(1, pred.shape[0])
    reg = F.smooth_l1_loss(pred.float(), target_f.float(), reduction="none").mean(-1).sum() / n
    with torch.no_grad():
        t_logits = feats.lm_head(target_f).float()
        t_probs = torch.softmax(t_logits, -1)
    d_logp = torch.log_softmax(feats.lm_head(pred).float(), -1)
    ce = -(t_probs * d_logp).sum() / n
    loss = cfg.regression_weight * reg + cfg.ce_weight * ce
    with torch.no_grad():
        acc = (d_logp.argmax(-1) == t_logits.argmax(-1)).float().sum() / n
        tokens = torch.tensor(float(pred.shape[0]))
    return loss, {"loss_reg": reg.detach(), "loss_ce": ce.detach(), "acc_top1_pos1": acc, "tokens": tokens}


def save(head: nn.Module, directory: str, cfg: EagleConfig, target: Any = None) -> None:
    """EAGLE layout: ``config.json`` (the target's LlamaConfig with the head's layers) + ``model.safetensors``."""
    core = extract_model_from_parallel(head)
    conf = {**core.config.to_dict(), "num_hidden_layers": cfg.num_layers, "architectures": ["LlamaForCausalLMEagle"]}
    save_head(core, directory, cfg, conf)


def load(directory: str, target: Any, cfg: EagleConfig | None = None) -> EagleHead:
    saved = read_head(directory, EagleConfig, target.config, "EAGLE head")
    head = EagleHead(target.config, saved.cfg.num_layers)
    load_state(head, saved.state, f"EAGLE checkpoint {directory}")
    return head.to(next(target.parameters()).dtype).eval()


def make_proposer(head: nn.Module, target: Any, cfg: EagleConfig) -> Any:

    return FeatureHeadProposer(head, output_head(target), cfg)


SPEC = register(
    DrafterSpec(
        name="eagle",
        export_module="train.export.eagle",
        config_cls=EagleConfig,
        build=build,
        loss=loss_fn,
        proposer=make_proposer,
        load=load,
        save=save,
    )
)
