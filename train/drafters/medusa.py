"""Medusa-1 heads on the frozen target (Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with
Multiple Decoding Heads", ICML 2024; github.com/FasterDecoding/Medusa).

``K = num_heads`` heads read the target's final hidden state ``h[t]`` (post-norm, the LM head's input). The
target's own LM head turns ``h[t]`` into token ``t+1``; head ``k`` (1-based) predicts token ``t+k+1``::

    z_k = ResBlock^num_layers(h[t])            ResBlock(x) = x + SiLU(Linear(x)), Linear H->H with bias,
                                               weight initialised to zero (a fresh head is the identity)
    logits_k = lm_head(z_k)                    the target's frozen LM head (own_lm_head=false, Medusa "v2"),
                                               or the head's own copy of it (own_lm_head=true, trained)

Loss: ``sum_k loss_decay**(k-1) * CE(logits_k[t], x[t+k+1])`` where ``x[t+k+1]`` is target-written (the
synth loss mask), each head averaged over its own counted positions; with ``soft_labels`` the CE is taken
against the target's whole next-token distribution at ``t+k`` (``softmax(lm_head(h[t+k]))``, what the target
verifies ``x[t+k+1]`` with) instead of the one token (Medusa-2's self-distillation). Parameter names follow Medusa's
``medusa_lm_head.safetensors`` under a ``heads.`` prefix: ``heads.{i}.{j}.linear.weight/bias`` (head ``i``,
ResBlock ``j``) and ``heads.{i}.{num_layers}.weight`` for an own LM head.

The loss also counts, per head and rank ``r < tree_top_k``, how often the rank-``r`` token was the right one
(``rank_hits`` / ``rank_count``, integer buffers saved with the weights; each head's counts are halved once
they pass ``RANK_WINDOW`` tokens, so they follow the recent model). The default decoding tree is built from
these accuracies (:func:`eval.proposers.medusa.default_tree_paths`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from accelerate.utils import extract_model_from_parallel
from torch import nn

from data.config import Bound, Choices, ConfigError, above, at_least
from data.target import output_head
from eval.config import DRAFT_SHAPE_BOUNDS, Decode
from eval.proposers.medusa import MedusaProposer, rank_prior
from eval.tree import static_tree_paths_to_parents
from train.drafters.layers import soft_cross_entropy
from train.drafters.registry import DrafterSpec, TargetFeatures, TrainBatch, register
from train.drafters.saving import load_state, read_head, save_head

RANK_WINDOW = 1 << 17
"""A head's rank counters are halved (integer division) once it has counted this many tokens."""


@dataclass
class MedusaConfig(Choices):
    """Medusa heads on the frozen target's last hidden state, and their decoding settings."""

    config_key: ClassVar[str] = "drafter"
    bounds: ClassVar[dict[str, Bound]] = {
        "num_heads": at_least(1),
        "num_layers": at_least(1),
        "loss_decay": above(0),
        **DRAFT_SHAPE_BOUNDS,
    }

    name: str = "medusa"
    num_heads: int = 4
    """K heads; head k (1-based) predicts token t+k+1 from the target's hidden state at t."""
    num_layers: int = 1
    """Residual blocks per head: ``x + SiLU(Linear(x))``."""
    own_lm_head: bool = False
    """False: every head reuses the target's frozen LM head (Medusa version 2). True: each head has its own
    vocabulary projection, initialised from the target's."""
    loss_decay: float = 0.8
    """Loss weight of head k is ``loss_decay ** (k - 1)`` (Medusa's lambda_k)."""
    soft_labels: bool = False
    """Train head k against the target's next-token distribution at t+k instead of the token x[t+k+1] (KL to
    the full distribution, as Medusa-2's self-distillation and EAGLE do); off = Medusa-1's hard labels."""
    decode: Decode = Decode.tree
    """tree (static Medusa tree of top-k paths) | chain (top-1 of each head)."""
    chain_k: int = 4
    tree_depth: int = 4
    tree_top_k: int = 8
    """Largest top-k rank the default tree may use at any depth."""
    tree_total_tokens: int = 16
    """Nodes in the default tree (chosen from the heads' measured top-k accuracies)."""
    tree_paths: list[list[int]] | None = None
    """Explicit static tree (Medusa top-k index paths, e.g. [[0], [1], [0, 0]]); None = the default tree."""


def validate(cfg: MedusaConfig) -> None:
    errors = []
    if cfg.num_heads < 1:
        errors.append(f"drafter.num_heads={cfg.num_heads} must be >= 1")
    if cfg.num_layers < 1:
        errors.append(f"drafter.num_layers={cfg.num_layers} must be >= 1")
    if not cfg.loss_decay > 0:
        errors.append(f"drafter.loss_decay={cfg.loss_decay} must be > 0")
    if cfg.chain_k < 1 or cfg.tree_depth < 1 or cfg.tree_top_k < 1 or cfg.tree_total_tokens < 1:
        errors.append("drafter.chain_k, tree_depth, tree_top_k and tree_total_tokens must be >= 1")
    if cfg.tree_paths:
        try:
            static_tree_paths_to_parents(cfg.tree_paths)
        except ValueError as e:
            errors.append(f"drafter.tree_paths: {e}")
        deepest = max(len(p) for p in cfg.tree_paths)
        if deepest > cfg.num_heads:
            errors.append(f"drafter.tree_paths has depth {deepest} > num_heads={cfg.num_heads}")
    if errors:
        raise ConfigError("Invalid medusa drafter config:\n  - " + "\n  - ".join(errors))


class ResBlock(nn.Module):
    """Medusa's residual block ``x + SiLU(Linear(x))``; the weight starts at zero, as in Medusa."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """``K`` Medusa heads; the target's LM head is passed in (never a parameter of this module)."""

    def __init__(
        self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int, own_lm_head: bool, top_k: int
    ) -> None:
        super().__init__()
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers, self.own_lm_head = num_heads, num_layers, own_lm_head
        self.heads = nn.ModuleList(
            [
                nn.Sequential(
                    *[ResBlock(hidden_size) for _ in range(num_layers)],
                    *([nn.Linear(hidden_size, vocab_size, bias=False)] if own_lm_head else []),
                )
                for _ in range(num_heads)
            ]
        )
        self.register_buffer("rank_hits", torch.zeros(num_heads, top_k, dtype=torch.long), persistent=True)
        self.register_buffer("rank_count", torch.zeros(num_heads, dtype=torch.long), persistent=True)

    def forward(self, xs: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
        """``xs[k]``: ``[..., H]`` rows for head ``k + 1`` (one tensor: the same rows for every head) ->
        ``[..., H]`` per head (``[..., V]`` logits with an own LM head). One call runs every head, so
        data-parallel wrappers see every parameter used once."""
        if isinstance(xs, torch.Tensor):
            xs = [xs] * self.num_heads
        dtype = self.heads[0][0].linear.weight.dtype
        return [head(x.to(dtype)) for head, x in zip(self.heads, xs, strict=True)]

    def head_logits(self, x: torch.Tensor, lm_head: Any, n: int | None = None) -> torch.Tensor:
        """Logits ``[n, N, V]`` of the first ``n`` heads (default: all) for hidden rows ``x`` ``[N, H]``."""
        n = self.num_heads if n is None else n
        outs = self([x] * n + [x[:0]] * (self.num_heads - n))[:n]
        if not self.own_lm_head:
            outs = [lm_head(z) for z in outs]
        return torch.stack(outs)

    def rank_accuracy(self) -> torch.Tensor:
        """``[K, R]`` measured probability that head ``k``'s rank-``r`` token is right, shrunk towards
        :func:`eval.proposers.medusa.rank_prior` by one pseudo-token (so an untrained head gets the prior)."""

        prior = rank_prior(*self.rank_hits.shape)
        hits, count = self.rank_hits.double().cpu(), self.rank_count.double().cpu()
        return (hits + prior) / (count[:, None] + 1)


def _core(model: nn.Module) -> MedusaHeads:
    """The MedusaHeads inside DDP / DeepSpeed wrappers."""
    m = extract_model_from_parallel(model)
    assert isinstance(m, MedusaHeads), type(model)
    return m


def build(cfg: MedusaConfig, target: Any) -> MedusaHeads:
    validate(cfg)
    tcfg = target.config
    heads = MedusaHeads(
        tcfg.hidden_size, tcfg.vocab_size, cfg.num_heads, cfg.num_layers, cfg.own_lm_head, cfg.tree_top_k
    )
    if cfg.own_lm_head:
        with torch.no_grad():
            w = target.get_output_embeddings().weight
            for head in heads.heads:
                head[cfg.num_layers].weight.copy_(w)
    return heads.to(next(target.parameters()).dtype)


def loss_fn(
    model: nn.Module, batch: TrainBatch, feats: TargetFeatures, cfg: MedusaConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Medusa-1 loss; see the module docstring. The LM head only runs on the counted rows."""
    h = feats.last  # [B, L, H]
    L = h.shape[1]
    ids = batch.input_ids
    K = cfg.num_heads
    core = _core(model)
    R = core.rank_hits.shape[1]
    written = (batch.loss_mask * batch.attention_mask).bool()
    teacher = h.new_zeros((0, 1), dtype=torch.float32)
    row_of = torch.full(written.shape, -1, dtype=torch.long, device=h.device)
    if cfg.soft_labels and L > 2:
        # the target's distribution over x[s+1] from its state at s, once for every s whose x[s+1] is
        # target-written: head k's teacher at t+k is row row_of[t+k] (the heads share most positions)
        at = written[:, 2:]
        row_of[:, 1 : L - 1][at] = torch.arange(int(at.sum()), device=h.device)
        with torch.no_grad():
            teacher = torch.softmax(feats.lm_head(h[:, 1 : L - 1][at]).float(), -1)
    xs, labels, teachers = [], [], []
    for k in range(1, K + 1):
        if L - k - 1 <= 0:
            xs.append(h[:, :0].reshape(0, h.shape[-1]))
            labels.append(ids[:, :0].reshape(0))
            teachers.append(teacher[:0])
            continue
        keep = written[:, k + 1 :]  # x[t+k+1] target-written
        xs.append(h[:, : L - k - 1][keep])
        labels.append(ids[:, k + 1 :][keep])
        if cfg.soft_labels:
            teachers.append(teacher[row_of[:, k : L - 1][keep]])
    outs = model(xs)
    loss = h.new_zeros((), dtype=torch.float32)
    metrics: dict[str, torch.Tensor] = {}
    hits = torch.zeros(K, R, dtype=torch.long, device=h.device)
    counts = torch.zeros(K, dtype=torch.long, device=h.device)
    for k in range(1, K + 1):
        z, y = outs[k - 1], labels[k - 1]
        logits = (z if cfg.own_lm_head else feats.lm_head(z)).float()
        n = y.shape[0]
        if cfg.soft_labels and n:
            ce = soft_cross_entropy(logits, teachers[k - 1])[0] / n
        else:
            ce = F.cross_entropy(logits, y, reduction="sum") / max(1, n)
        loss = loss + cfg.loss_decay ** (k - 1) * ce
        with torch.no_grad():
            top = logits.topk(min(max(5, R), logits.shape[-1]), dim=-1).indices
            match = top == y[:, None]  # [n, max(5, R)]
            hits[k - 1, : min(R, match.shape[1])] = match[:, :R].sum(0)
            counts[k - 1] = n
            metrics[f"loss_head{k}"] = ce.detach()
            metrics[f"acc_head{k}_top1"] = match[:, :1].any(-1).float().sum() / max(1, n)
            metrics[f"acc_head{k}_top5"] = match[:, :5].any(-1).float().sum() / max(1, n)
    with torch.no_grad():
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(hits)  # identical counters on every rank, as with one process
            dist.all_reduce(counts)
        core.rank_hits += hits.to(core.rank_hits.device)
        core.rank_count += counts.to(core.rank_count.device)
        full = core.rank_count >= RANK_WINDOW
        if bool(full.any()):
            core.rank_hits[full] //= 2
            core.rank_count[full] //= 2
        metrics["acc_top1_pos1"] = metrics["acc_head1_top1"]
        metrics["tokens"] = torch.tensor(float(labels[0].shape[0]))
    return loss, metrics


def save(heads: nn.Module, directory: str, cfg: MedusaConfig, target: Any = None) -> None:
    """``model.safetensors`` + ``config.json`` (sizes, Medusa's own keys, and ``draftsmith.drafter``)."""
    core = _core(heads)
    conf = {
        "architectures": ["MedusaHeads"],
        "hidden_size": core.hidden_size,
        "vocab_size": core.vocab_size,
        "medusa_num_heads": core.num_heads,
        "medusa_num_layers": core.num_layers,
    }
    save_head(core, directory, cfg, conf)


def load(directory: str, target: Any, cfg: MedusaConfig | None = None) -> MedusaHeads:
    saved = read_head(directory, MedusaConfig, target.config, "Medusa heads")
    c, tcfg = saved.cfg, target.config
    top_k = saved.state["rank_hits"].shape[1] if "rank_hits" in saved.state else c.tree_top_k
    heads = MedusaHeads(tcfg.hidden_size, tcfg.vocab_size, c.num_heads, c.num_layers, c.own_lm_head, top_k)
    load_state(heads, saved.state, f"Medusa checkpoint {directory}")
    return heads.to(next(target.parameters()).dtype).eval()


def make_proposer(heads: nn.Module, target: Any, cfg: MedusaConfig) -> Any:

    return MedusaProposer(_core(heads), output_head(target), cfg)


def check(cfg: MedusaConfig, target: Any) -> None:
    validate(cfg)


SPEC = register(
    DrafterSpec(
        name="medusa",
        export_module="train.export.medusa",
        config_cls=MedusaConfig,
        build=build,
        loss=loss_fn,
        proposer=make_proposer,
        load=load,
        save=save,
        check=check,
    )
)
