"""SwiGLU of the fused gate/up projection's output (Triton): `silu(gate) * up`, one pass.

The decode layer's gate/up projection writes `[N, 2I]` (gate columns, then up columns); the MLP's
down projection reads `silu(gate) * up`, `[N, I]`. Compiled by inductor with dynamic shapes, that
pointwise kernel took 4.2 us at 256 rows of Qwen3-0.6B's I = 3,072 on an H200 (workload A's
profile, RESULTS.md): about 1 TB/s for its 4.7 MB, the index arithmetic of a symbolic width per
element. Here one program takes one row's `BLOCK` columns, so the addresses are a row offset plus a
range, and the two halves are read as contiguous vectors. The product is computed in fp32 and
rounded once, as inductor's kernel does. The grid depends only on the shape (CUDA graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from laden.rollout.native.kernels.options import SwigluOptions

_DEFAULT = SwigluOptions()  # the settings' meanings: `SwigluOptions`


@triton.jit
def _swiglu(GU, OUT, half, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < half
    base = GU + row * stride_g
    g = tl.load(base + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(base + half + col, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(OUT + row * stride_o + col, y.to(OUT.dtype.element_ty), mask=mask)


def swiglu(
    gu: torch.Tensor, *, block: int = _DEFAULT.block, num_warps: int = _DEFAULT.num_warps
) -> torch.Tensor:
    """`gu [N, 2I]` (unit stride along the features) -> `silu(gu[:, :I]) * gu[:, I:]`, `[N, I]` in
    gu's dtype."""
    n, width = gu.shape
    if width % 2 or gu.stride(1) != 1:
        raise ValueError(f"swiglu needs [N, 2I] with unit stride along the features, got {tuple(gu.shape)}")
    half = width // 2
    out = torch.empty(n, half, device=gu.device, dtype=gu.dtype)
    if n:
        _swiglu[(n, triton.cdiv(half, block))](
            gu, out, half, gu.stride(0), out.stride(0), BLOCK=block, num_warps=num_warps
        )
    return out
