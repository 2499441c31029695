"""Fixtures for the eval tests: tiny random Llama target / draft pairs (no downloads).

``target_and_draft`` is the injection point for other model pairs: add a name to
``_PAIR_BUILDERS`` (and to the fixture's ``params``) with a builder returning a :class:`ModelPair`;
every greedy-identity / rollback / HF-comparison test then runs on it too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


@dataclass
class ModelPair:
    """A target and a draft sharing a vocabulary, plus prompts to decode from."""

    name: str
    target: torch.nn.Module
    draft: torch.nn.Module
    prompts: list[torch.Tensor]  # each LongTensor[1, T]
    eos_token_id: int | list[int] | None = None
    max_new_tokens: int = 32
    static_paths: list[tuple[int, ...]] = field(
        default_factory=lambda: [
            (0,),
            (1,),
            (2,),
            (0, 0),
            (0, 1),
            (1, 0),
            (0, 0, 0),
            (0, 0, 1),
            (0, 1, 0),
            (0, 0, 0, 0),
        ]
    )


def make_tiny_llama(
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    init_std: float = 0.05,
    seed: int = 0,
    attn_implementation: str = "sdpa",
) -> LlamaForCausalLM:
    """A seeded random ``LlamaForCausalLM`` in eval mode (fp32, CPU)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        initializer_range=init_std,
        attn_implementation=attn_implementation,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(cfg).eval()


def perturbed_copy(model: LlamaForCausalLM, rel_noise: float, seed: int) -> LlamaForCausalLM:
    """Same architecture, every matrix perturbed by N(0, (rel_noise * init_std)^2) noise."""
    std = model.config.initializer_range
    copy = make_tiny_llama(
        vocab_size=model.config.vocab_size,
        hidden_size=model.config.hidden_size,
        num_layers=model.config.num_hidden_layers,
        num_heads=model.config.num_attention_heads,
        num_kv_heads=model.config.num_key_value_heads,
        init_std=std,
        seed=seed,
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p, p_ref in zip(copy.parameters(), model.parameters(), strict=True):
            noise = rel_noise * std * torch.randn(p.shape, generator=gen) if p.ndim == 2 else 0.0
            p.copy_(p_ref + noise)
    return copy


def _tiny_llama_pair() -> ModelPair:
    # A draft that is a noisy copy of the target accepts ~50% per position (alpha ~0.5), so steps
    # with 0..K accepted tokens all occur; init_std 0.05 gives non-degenerate greedy outputs.
    target = make_tiny_llama(seed=0)
    draft = perturbed_copy(target, rel_noise=0.2, seed=5)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (1, 12), generator=gen) for _ in range(2)]
    # a prompt with repetitions so prompt lookup has something to find
    prompts.append(torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]]))
    return ModelPair(name="tiny_llama", target=target, draft=draft, prompts=prompts, max_new_tokens=32)


_PAIR_BUILDERS: dict[str, Callable[[], ModelPair]] = {"tiny_llama": _tiny_llama_pair}


@pytest.fixture(scope="session", params=list(_PAIR_BUILDERS))
def target_and_draft(request: pytest.FixtureRequest) -> ModelPair:
    """Target/draft pair used by the greedy-identity, rollback and HF-comparison tests."""
    return _PAIR_BUILDERS[request.param]()


@pytest.fixture(scope="session")
def tiny_vocab_pair() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """(target, draft): two unrelated random Llamas over a 4-token vocabulary with peaked outputs.

    Used by the end-to-end sampling-distribution tests, where the exact target distribution of the
    first tokens can be enumerated.  A large init std makes both models confident and different,
    so rejections (and residual sampling) happen often.
    """
    kw = {"vocab_size": 4, "hidden_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "init_std": 0.5}
    return make_tiny_llama(seed=0, **kw), make_tiny_llama(seed=1, **kw)


@pytest.fixture(scope="package", autouse=True)
def _single_thread() -> Iterator[None]:
    """Tiny models are dominated by thread-pool overhead on small CI machines: one thread while the
    tests of this package run (restored afterwards)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def chi_square(counts: Sequence[int] | torch.Tensor, probs: Sequence[float] | torch.Tensor) -> tuple[float, float]:
    """Pearson chi-square statistic of ``counts`` against ``probs`` and its 0.1% critical value.

    Cells with expected count < 5 are pooled into one cell.  The critical value uses the
    Wilson-Hilferty approximation of the chi-square quantile (z = 3.09 for p = 0.001).
    Returns ``(statistic, critical_value)``; "consistent" means ``statistic < critical_value``.
    """
    c = torch.as_tensor(counts, dtype=torch.float64).reshape(-1)
    p = torch.as_tensor(probs, dtype=torch.float64).reshape(-1)
    n = float(c.sum())
    exp = p / p.sum() * n
    big = exp >= 5
    obs_cells = c[big].tolist()
    exp_cells = exp[big].tolist()
    if (~big).any():
        obs_cells.append(float(c[~big].sum()))
        exp_cells.append(float(exp[~big].sum()))
    stat = 0.0
    for o, e in zip(obs_cells, exp_cells, strict=True):
        if e > 0:
            stat += (o - e) ** 2 / e
        elif o > 0:
            stat = math.inf
    df = max(1, len(obs_cells) - 1)
    z = 3.09
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, crit


@pytest.fixture(scope="session")
def chi2() -> Callable[[Sequence[int] | torch.Tensor, Sequence[float] | torch.Tensor], tuple[float, float]]:
    """The :func:`chi_square` helper as a fixture (test modules do not import conftest)."""
    return chi_square
