"""Optimizers for stage train: AdamW, or Muon on the hidden weight matrices with AdamW on the rest.

``train.optimizer=muon`` is the split speculators' EAGLE-3 trainer defaults to (and Keller Jordan's Muon
recommends): every trainable 2-D matrix with both sides > 1 gets Muon (momentum, then the update orthogonalised by
a quintic Newton-Schulz iteration), except embeddings and vocabulary projections (``embed_tokens``, ``lm_head``),
which stay with AdamW together with norms, biases and vectors. One :class:`torch.optim.Optimizer` holds both kinds
of parameter group, so accelerate wraps, clips, schedules (one LambdaLR scales both groups' learning rates) and
checkpoints it like AdamW alone.

The Muon group's math is ``torch.optim.Muon``'s (the same momentum, Nesterov form, coefficients, decoupled weight
decay and ``match_rms_adamw`` learning-rate adjustment, ``0.2 * sqrt(max(rows, cols))``), except the dtype of the
Newton-Schulz iteration: torch runs it in bf16, which a CPU without native bf16 products emulates very slowly
(speculators' trainer needed ~28 s a step on 2 cores), so ``ns_dtype`` defaults to bf16 on accelerators and fp32
on a CPU. ``tests/test_train/test_optim.py`` checks both groups step for step against ``torch.optim.Muon`` and
``torch.optim.AdamW``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.adamw import adamw

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic; torch.optim.Muon's defaults
NS_EPS = 1e-7
ADAMW_NAME_HINTS = ("embed_tokens", "lm_head")  # 2-D, but vocabulary-sized: AdamW, as Muon practice has it


def split_for_muon(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter], list[str]]:
    """(Muon parameters, AdamW parameters, Muon parameter names) of a model's trainable parameters."""
    muon: list[nn.Parameter] = []
    adamw: list[nn.Parameter] = []
    names: list[str] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim == 2 and min(p.shape) > 1 and not any(h in name for h in ADAMW_NAME_HINTS):
            muon.append(p)
            names.append(name)
        else:
            adamw.append(p)
    return muon, adamw, names


def orthogonalise(
    g: torch.Tensor,
    steps: int,
    dtype: torch.dtype,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
) -> torch.Tensor:
    """The quintic Newton-Schulz iteration of Muon (``torch.optim._muon``'s), computed in ``dtype`` (also the peer
    trainer's, ``scripts/bench_peer.py``, with the coefficients torch passes it)."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        upd = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, upd, x, beta=a)
    return x.T if tall else x


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the groups marked ``muon=True``, AdamW (decoupled weight decay, bias-corrected) on the others."""

    def __init__(
        self,
        muon_params: Iterable[nn.Parameter],
        adamw_params: Iterable[nn.Parameter],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.0,
        eps: float = 1e-8,
        muon_lr: float | None = None,
        muon_momentum: float = 0.95,
        muon_weight_decay: float = 0.1,
        ns_steps: int = 5,
        ns_dtype: torch.dtype = torch.float32,
    ) -> None:
        groups: list[dict[str, Any]] = []
        muon_list, adamw_list = list(muon_params), list(adamw_params)
        for p in muon_list:
            if p.ndim != 2:
                raise ValueError(f"Muon takes 2-D matrices only, got a parameter of shape {tuple(p.shape)}")
        if muon_list:
            groups.append(
                {
                    "params": muon_list,
                    "muon": True,
                    "lr": lr if muon_lr is None else muon_lr,
                    "weight_decay": muon_weight_decay,
                }
            )
        if adamw_list:
            groups.append({"params": adamw_list, "muon": False, "lr": lr, "weight_decay": weight_decay})
        if not groups:
            raise ValueError("no trainable parameters to optimize")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "momentum": muon_momentum,
            "ns_steps": ns_steps,
        }
        super().__init__(groups, defaults)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["muon"]:
                self._muon(group)
            else:
                self._adamw(group)
        return loss

    def _muon(self, group: dict[str, Any]) -> None:
        lr, wd, mom = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - mom)
            update = orthogonalise(p.grad.lerp(buf, mom), group["ns_steps"], self.ns_dtype)  # Nesterov
            p.mul_(1 - lr * wd)
            p.add_(update.to(p.dtype), alpha=-lr * 0.2 * math.sqrt(max(p.shape[0], p.shape[1])))

    def _adamw(self, group: dict[str, Any]) -> None:
        """torch's own single-tensor AdamW on the group, its state kept as torch.optim.AdamW keeps it."""
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        b1, b2 = group["betas"]
        adamw(
            params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
            [s["step"] for s in states], foreach=False, amsgrad=False, beta1=b1, beta2=b2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
        )  # fmt: skip


def build_optimizer(
    model: nn.Module, tcfg: Any, device: torch.device, deepspeed: bool = False
) -> tuple[torch.optim.Optimizer, str]:
    """The optimizer ``train.optimizer`` names over the model's trainable parameters, and a line for the log.
    ``deepspeed``: a DeepSpeed engine will wrap it (ZeRO hands the optimizer flat 1-D shards, not matrices)."""
    betas = (tcfg.beta1, tcfg.beta2)
    if str(tcfg.optimizer) == "adamw":
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=tcfg.lr, betas=betas, weight_decay=tcfg.weight_decay), "AdamW"
    if deepspeed:
        raise ValueError(
            "train.optimizer=muon needs whole weight matrices, but DeepSpeed ZeRO flattens and shards the parameters "
            "it gives the optimizer: use deepspeed=none (DDP across processes) with Muon, or train.optimizer=adamw"
        )
    muon, adamw, names = split_for_muon(model)
    if not muon:
        raise ValueError("train.optimizer=muon: this drafter has no trainable 2-D hidden matrix for Muon")
    ns_dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    opt = MuonAdamW(
        muon,
        adamw,
        lr=tcfg.lr,
        betas=betas,
        weight_decay=tcfg.weight_decay,
        muon_lr=tcfg.muon_lr,
        muon_momentum=tcfg.muon_momentum,
        muon_weight_decay=tcfg.muon_weight_decay,
        ns_dtype=ns_dtype,
    )
    n_muon = sum(p.numel() for p in muon)
    n_adamw = sum(p.numel() for p in adamw)
    line = (
        f"Muon on {len(muon)} matrices ({n_muon:,} parameters: {', '.join(names[:4])}"
        f"{', ...' if len(names) > 4 else ''}), AdamW on {len(adamw)} tensors ({n_adamw:,})"
    )
    return opt, line
