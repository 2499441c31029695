"""Lockstep lanes (eval/lanes.py): linear layers called from many threads are computed in shared products, each
thread gets its own rows, a failing call fails only its lane, and calls from other threads are not held up."""

from __future__ import annotations

import threading

import torch
from torch import nn

from eval.lanes import LaneBatcher, batchable_linears, batched_linears


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _run_lanes(model: _Toy, inputs: list[torch.Tensor], steps: list[int], batcher: LaneBatcher) -> list[object]:
    out: list[object] = [None] * len(inputs)
    start = threading.Barrier(len(inputs))

    def lane(i: int) -> None:
        with batcher.lane():
            start.wait()  # every lane has joined before the first call (as replay's lanes wait for their prompts)
            try:
                x = inputs[i]
                for _ in range(steps[i]):  # lanes run different numbers of layers: they fall out of step
                    x = model(x)
                out[i] = x
            except Exception as exc:  # the test inspects it
                out[i] = exc

    threads = [threading.Thread(target=lane, args=(i,)) for i in range(len(inputs))]
    with batched_linears(batchable_linears(_Holder(model))):
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a lane hung"
    return out


class _Holder:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.method = model.forward  # bound methods of modules are found too


def test_lanes_compute_the_same_rows_in_shared_products() -> None:
    torch.manual_seed(0)
    model = _Toy()
    inputs = [torch.randn(1 + i % 3, 8) for i in range(6)]  # different row counts per lane
    steps = [3, 5, 1, 4, 4, 2]
    batcher = LaneBatcher()
    with torch.inference_mode():
        got = _run_lanes(model, inputs, steps, batcher)
        for x, n, y in zip(inputs, steps, got, strict=True):
            ref = x
            for _ in range(n):
                ref = model(ref)  # the main thread: not a lane, computed directly
            assert isinstance(y, torch.Tensor)
            torch.testing.assert_close(y, ref)
    calls = 2 * sum(steps)
    assert batcher.products < calls / 2, f"{batcher.products} products for {calls} calls: nothing was batched"
    assert "forward" not in vars(model.a), "the layers must be restored after the block"


def test_a_failing_call_fails_only_its_lane() -> None:
    model = _Toy()
    inputs = [torch.randn(2, 8), torch.randn(2, 5), torch.randn(1, 8)]  # the second has the wrong width
    with torch.inference_mode():
        got = _run_lanes(model, inputs, [2, 2, 2], LaneBatcher())
    assert isinstance(got[0], torch.Tensor) and isinstance(got[2], torch.Tensor)
    assert isinstance(got[1], RuntimeError)


def test_only_plain_linears_of_held_modules_are_batched() -> None:
    class Sub(nn.Linear):
        pass

    m = nn.Sequential(nn.Linear(2, 2), Sub(2, 2))
    found = batchable_linears(_Holder(m))
    assert len(found) == 1 and type(found[0]) is nn.Linear
