"""The CPU runtime settings a training process starts with: the fused soft-label cross-entropy that replaced the
composite in EAGLE-3's loss, and glibc's allocator kept from returning large tensors to the kernel."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from train.drafters.layers import soft_cross_entropy

ROOT = Path(__file__).resolve().parents[2]


def test_soft_cross_entropy_gradient_is_exact_in_double() -> None:
    torch.manual_seed(0)
    z = torch.randn(6, 40, dtype=torch.double, requires_grad=True)
    t = torch.softmax(torch.randn(6, 40, dtype=torch.double), -1)
    assert torch.autograd.gradcheck(lambda x: soft_cross_entropy(x, t)[0], (z,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_cross_entropy_equals_the_composite(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    z = (torch.randn(33, 8192) * 3).to(dtype).requires_grad_(True)
    t = torch.softmax(torch.randn(33, 8192) * 2, -1) * 0.999  # rows that sum to slightly less than 1 count too
    ref_z = z.detach().clone().requires_grad_(True)
    ref = -(t * torch.log_softmax(ref_z.float(), -1)).sum()
    ref.backward()
    loss, top = soft_cross_entropy(z, t)
    loss.backward()
    assert loss.dtype == torch.float32 and z.grad is not None and z.grad.dtype == dtype
    assert torch.allclose(loss, ref, rtol=1e-5)
    assert torch.allclose(z.grad.float(), ref_z.grad.float(), atol=1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(top, z.detach().float().argmax(-1))
    with pytest.raises(ValueError, match=r"two \[N, V\] tensors"):
        soft_cross_entropy(z, t[:, :10])


CHURN = """
import resource, sys, torch
from train.__main__ import keep_freed_memory

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def churn():
    f0 = faults()
    for _ in range(6):
        x = torch.ones(25_000_000)  # 100 MB, every page written
        del x
    return faults() - f0

churn()
if sys.argv[1] == "keep":
    assert keep_freed_memory()
print(churn())
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_keep_freed_memory_stops_large_tensors_faulting_in_again() -> None:
    """Six 100 MB tensors made and freed in turn: by default each is a fresh mapping whose ~24k pages fault in
    again; with ``runtime.keep_freed_memory`` the first one's heap pages are reused."""
    counts = {}
    for mode in ("default", "keep"):
        out = subprocess.run([sys.executable, "-c", CHURN, mode], cwd=ROOT, capture_output=True, text=True, check=True)
        counts[mode] = int(out.stdout.split()[-1])
    assert counts["default"] > 5 * 20_000, counts
    assert counts["keep"] < 2 * 25_000, counts


def test_openmp_wait_is_a_short_spin_unless_the_user_chose() -> None:
    """``python -m train`` sets ``GOMP_SPINCOUNT`` before torch loads (libgomp reads it once); a user's own
    ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` (even empty) is left alone."""
    from train.omp import SPIN_COUNT, set_default_wait

    env: dict[str, str] = {}
    assert set_default_wait(env) == f"GOMP_SPINCOUNT={SPIN_COUNT}" and env == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}
    for mine in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": ""}, {"GOMP_SPINCOUNT": "0"}):
        env = dict(mine)
        set_default_wait(env)
        assert env == mine
    probe = (
        "import os, sys; import train.__main__ as m; "
        "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules, m.OMP_WAIT)"
    )
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=base, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(SPIN_COUNT), "None", "True", f"GOMP_SPINCOUNT={SPIN_COUNT}"]
    mine = {**base, "OMP_WAIT_POLICY": "PASSIVE"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=mine, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["None", "PASSIVE", "True", "OMP_WAIT_POLICY=PASSIVE"]


def test_cudnn_sdpa_switch_reaches_torch() -> None:
    """``runtime.cudnn_sdpa=false`` turns off SDPA's cuDNN backend in the process (the flag torch's CUDA
    dispatcher reads; a CPU build keeps it too), and the default leaves torch's own choice on."""
    from tests.conftest import compose
    from train.__main__ import setup_runtime

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        setup_runtime(compose(["runtime.cudnn_sdpa=false", "runtime.keep_freed_memory=false"]))
        assert torch.backends.cuda.cudnn_sdp_enabled() is False
        setup_runtime(compose(["runtime.keep_freed_memory=false"]))
        assert torch.backends.cuda.cudnn_sdp_enabled() is True
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.parametrize(
    ("env", "setting", "threads"), [("3", 0, 3), ("3", 2, 2), (None, 0, os.cpu_count()), ("x", 0, os.cpu_count())]
)
def test_torch_threads_follow_omp_num_threads_unless_set(
    monkeypatch: pytest.MonkeyPatch, env: str | None, setting: int, threads: int
) -> None:
    """``runtime.num_threads=0`` takes OMP_NUM_THREADS (a SLURM job's or a shared machine's share) when it is a
    number, else every core; a number set in the config wins."""
    from tests.conftest import compose
    from train.__main__ import setup_runtime

    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    before = torch.get_num_threads()
    try:
        setup_runtime(compose([f"runtime.num_threads={setting}", "runtime.keep_freed_memory=false"]))
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
