"""laden's SwiGLU kernel against `silu(gate) * up` in torch.

On the CPU through Triton's interpreter when Triton is installed (`TRITON_INTERPRET=1`, in a
subprocess: the variable is read at import); on a GPU in bf16 and fp32 (`gpu` marker)."""

from __future__ import annotations

import pytest
import torch
from interpreted import interpret_check, run_check

from laden.rollout.native.attention import triton_available

CASES = """
import torch, torch.nn.functional as F
from laden.rollout.native.kernels.triton_swiglu import swiglu

def check(dtype, device, tol):
    torch.manual_seed(0)
    for rows, half, block in [(1, 64, 64), (5, 100, 64), (3, 300, 128), (0, 64, 64), (17, 32, 1024)]:
        gu = torch.randn(rows, 2 * half, device=device, dtype=dtype) * 4
        g, u = gu.float().chunk(2, dim=-1)
        want = F.silu(g) * u
        got = swiglu(gu, block=block)
        assert got.dtype == dtype and got.shape == (rows, half)
        err = (got.float() - want).abs().max().item() if rows else 0.0
        assert err < tol * max(1.0, want.abs().max().item() if rows else 1.0), (rows, half, block, err)
    wide = torch.randn(4, 2 * 96, device=device, dtype=dtype)[:, :128]  # a row stride wider than 2I
    assert torch.allclose(swiglu(wide, block=64).float(), F.silu(wide[:, :64].float()) * wide[:, 64:].float(), atol=tol)
    try:
        swiglu(torch.randn(2, 7, device=device, dtype=dtype))
    except ValueError as e:
        assert "[N, 2I]" in str(e)
    else:
        raise AssertionError("an odd width was accepted")
"""


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
def test_swiglu_in_the_interpreter():
    interpret_check(CASES, torch.float32, "cpu", 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_swiglu_on_cuda(dtype):
    run_check(CASES, dtype, "cuda", 2e-2 if dtype == torch.bfloat16 else 1e-5)
