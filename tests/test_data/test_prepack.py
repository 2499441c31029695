"""oneDNN-prepacked linears (data/prepack.py) on the real target: the packed kernel really runs inside the block,
its logits agree with F.linear's to float32 rounding and pick the same tokens, gradients and other dtypes fall
back, and every layer is itself again after the block (also after an error inside it)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from data.prepack import can_prepack, prepacked_linears
from data.render import prompt_ids

pytestmark = pytest.mark.slow

TEXTS = ("Write a haiku about the sea.", "def fibonacci(n):", "What is the capital of France? Answer briefly.")


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def _ops(fn) -> set[str]:  # the aten/mkldnn ops a call runs
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@pytest.fixture(scope="module")
def batch(target) -> torch.Tensor:
    rows = [prompt_ids(target.tokenizer, [{"role": "user", "content": t}]) for t in TEXTS]
    width = max(map(len, rows))
    return torch.tensor([[r[0]] * (width - len(r)) + r for r in rows])


def test_packed_kernel_runs_and_agrees_with_f_linear(target, batch) -> None:
    model = target.model
    assert can_prepack(model)
    with torch.inference_mode():
        ref = model(input_ids=batch, use_cache=False).logits
        with prepacked_linears(model) as n:
            assert n == len(_linears(model)) == 30 * 7 + 1  # q k v o gate up down per layer + lm_head
            assert all("forward" in m.__dict__ for m in _linears(model))
            out = model(input_ids=batch, use_cache=False).logits
            ops = _ops(lambda: model(input_ids=batch[:, :8], use_cache=False))
        after = model(input_ids=batch, use_cache=False).logits
    assert "mkldnn::_linear_pointwise" in ops and "aten::mm" not in ops  # every product went through the packs
    assert not any("forward" in m.__dict__ for m in _linears(model))  # restored
    assert torch.equal(after, ref)  # and really F.linear again
    # float32 rounding, not another model: oneDNN's blocked kernels sum in another order than F.linear's GEMM; on a
    # CPU with AVX2 only (no AVX-512) the logits (magnitude ~10-30) differ by up to 1.6e-4 after 30 layers
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-3)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def test_gradients_and_other_dtypes_fall_back(target, batch) -> None:
    model = target.model
    lin = model.model.layers[0].mlp.gate_proj
    x = torch.randn(3, lin.in_features, requires_grad=True)
    with prepacked_linears(model):
        y = lin(x)  # grad enabled: F.linear, differentiable
        assert y.grad_fn is not None and torch.equal(y, nn.functional.linear(x, lin.weight, lin.bias))
        with prepacked_linears(model) as inner:
            assert inner == 0  # nested: the outer block's packs stay
    assert "forward" not in lin.__dict__
    with prepacked_linears(model, enabled=False) as n:
        assert n == 0 and "forward" not in lin.__dict__

    class Scaled(nn.Linear):  # a subclass with its own forward is left alone
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    mixed = nn.Sequential(nn.Linear(8, 4), Scaled(4, 4))
    with torch.inference_mode(), prepacked_linears(mixed) as n:
        assert n == 1 and "forward" not in mixed[1].__dict__
        x = torch.randn(2, 8)
        h = nn.functional.linear(x, mixed[0].weight, mixed[0].bias)
        torch.testing.assert_close(mixed(x), 2 * nn.functional.linear(h, mixed[1].weight, mixed[1].bias))
    half = nn.Linear(8, 4).to(torch.bfloat16)
    assert not can_prepack(half)
    with prepacked_linears(half) as n:
        assert n == 0


def test_layers_are_restored_after_an_error(target) -> None:
    model = target.model
    with pytest.raises(KeyError), prepacked_linears(model) as n:
        assert n > 0
        raise KeyError("inside the block")
    assert not any("forward" in m.__dict__ for m in _linears(model))


def test_continuous_engine_rows_equal_with_and_without_packs(target) -> None:
    """Stage synth's engine with and without the packs (synth.prepack): the same greedy rows, token for token."""
    from data.generate import continuous_generate

    tok = target.tokenizer
    prompts = sorted(
        (prompt_ids(tok, [{"role": "user", "content": t}]) for t in (*TEXTS, "Hi", "List three fruits.")), key=len
    )
    kw = {"eos_token_id": tok.eos_token_id, "batch_size": 3}
    packed, _ = continuous_generate(target.model, prompts, 32, prepack=True, **kw)
    plain, _ = continuous_generate(target.model, prompts, 32, prepack=False, **kw)
    assert packed == plain
