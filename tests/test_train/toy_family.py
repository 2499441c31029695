"""A drafter family that lives outside the project: a low-rank bigram table over the target's vocabulary.

It exists to prove that a family is one module plus one registration line (the ``register`` call below, found
through ``DRAFTSMITH_DRAFTERS=tests.test_train.toy_family``): no file of the project names it, no YAML is needed
(``drafter=toy`` selects its dataclass), and stage train, eval and export all take it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from eval.proposers.base import Proposer, TargetOutput
from eval.tree import DraftTree, chain
from train.drafters.registry import DrafterSpec, TargetFeatures, TrainBatch, register
from train.drafters.saving import load_state, read_weights, save_head


@dataclass
class ToyConfig:
    name: str = "toy"
    rank: int = 16
    decode: str = "chain"
    chain_k: int = 3
    tree_depth: int = 3
    tree_top_k: int = 2
    tree_total_tokens: int = 6


class Bigram(nn.Module):
    def __init__(self, vocab: int, rank: int) -> None:
        super().__init__()
        self.inp = nn.Embedding(vocab, rank)
        self.out = nn.Linear(rank, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.inp(ids))


def build(cfg: ToyConfig, target_model: Any) -> nn.Module:
    return Bigram(int(target_model.config.vocab_size), cfg.rank)


def loss(
    module: nn.Module, batch: TrainBatch, feats: TargetFeatures, cfg: ToyConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Next token from the current one, on target-written tokens."""
    keep = (batch.loss_mask[:, 1:] * batch.attention_mask[:, 1:]).bool()
    logits = module(batch.input_ids[:, :-1])[keep]
    labels = batch.input_ids[:, 1:][keep]
    ce = nn.functional.cross_entropy(logits.float(), labels)
    acc = (logits.argmax(-1) == labels).float().mean()
    return ce, {"acc_top1_pos1": acc.detach(), "tokens": torch.tensor(float(labels.numel()))}


class BigramProposer(Proposer):
    name = "toy"

    def __init__(self, module: nn.Module, k: int) -> None:
        self.module, self.chain_k = module, k

    def begin(self, prompt_ids: torch.Tensor, target_out: TargetOutput) -> None:
        return None

    @torch.no_grad()
    def propose(self, context: torch.Tensor) -> DraftTree:
        tok, toks, probs = int(context[-1]), [], []
        for _ in range(self.chain_k):
            tok = self.draft_token(self.module(torch.tensor([tok]))[0].float(), probs)
            toks.append(tok)
        return chain(toks, torch.stack(probs) if probs else None)


def save(module: nn.Module, directory: str, cfg: ToyConfig, target: Any) -> None:
    vocab = int(module.out.out_features)
    save_head(module, directory, cfg, {"hidden_size": None, "vocab_size": vocab})


def load(directory: str, target_model: Any, cfg: ToyConfig) -> nn.Module:
    module = build(cfg, target_model)
    load_state(module, read_weights(directory), f"toy drafter {directory}")
    return module.eval()


SPEC = register(
    DrafterSpec(
        name="toy",
        config_cls=ToyConfig,
        build=build,
        loss=loss,
        proposer=lambda module, target_model, cfg: BigramProposer(module, cfg.chain_k),
        load=load,
        save=save,
    )
)
