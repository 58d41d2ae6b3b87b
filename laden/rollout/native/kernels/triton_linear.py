"""laden's linear layer for the decode step's few rows (Triton): `x @ w.T (+ residual)`, split-K.

A decode step multiplies a handful of rows (the batch's last tokens) by every weight matrix of
the model, so it is bound by reading the weights, not by arithmetic. cuBLAS covers an output
of a few thousand features with a few dozen tiles, one per SM, each streaming its whole share of
the weights alone: on an H200 a 4 MB projection of one row took 4.5 us, about 1 TB/s of the 4.8
the memory gives. This kernel cuts the reduction dimension too (split-K), so a projection runs
as hundreds of small programs that keep enough loads in flight to stream the weights at full
speed; each program multiplies its `[rows, BK]` slice of x by its `[BN, BK]` tiles of the weight
on tensor cores (rows padded to 16) and accumulates in fp32.

With one split the program writes the output (plus the bias and the residual, when given) itself; otherwise
each split writes an fp32 partial and a second kernel sums them in a fixed order (deterministic:
no atomics) and adds the bias and the residual. The launch depends only on the shapes (CUDA graph safe).
`pick_config` chooses the tiles and splits from the shape and the SM count; `None` there means
cuBLAS is the better choice (many rows, or an output wide enough that cuBLAS's own tiles fill
the GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from laden.rollout.native.kernels.options import LinearOptions


@dataclass(frozen=True, slots=True)
class LinearConfig:
    """Tiles (`block_m` rows padded to it, `block_n` output features, `block_k` reduction) and the
    number of K splits, warps and pipeline stages of one launch."""

    block_m: int
    block_n: int
    block_k: int
    splits: int
    num_warps: int = 4
    num_stages: int = 4


_DEFAULT = LinearOptions()  # the settings' meanings and measurements: `LinearOptions`


@triton.jit
def _linear_splitk(
    X, W, Y, R, BIAS, PART,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_ym, stride_rm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DIRECT: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptr = X + offs_m[:, None].to(tl.int64) * stride_xm
    w_ptr = W + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        kk = k + offs_k
        k_mask = kk < k_end
        a = tl.load(x_ptr + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptr + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(a, tl.trans(b), input_precision=PRECISION)
    out_mask = m_mask[:, None] & n_mask[None, :]
    if DIRECT:
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_RES:
            r = tl.load(R + offs_m[:, None] * stride_rm + offs_n[None, :], mask=out_mask, other=0.0)
            acc += r.to(tl.float32)
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=out_mask)
    else:
        part = PART + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
        tl.store(part, acc, mask=out_mask)


@triton.jit
def _sum_splits(
    PART, Y, R, BIAS, M, N, stride_ym, stride_rm,
    SPLITS: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(PART + (s * M + row).to(tl.int64) * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        acc += tl.load(R + row * stride_rm + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_ym + offs, acc.to(Y.dtype.element_ty), mask=mask)


def shared_memory(config: LinearConfig, element_size: int = 2) -> int:
    """Bytes of shared memory the pipeline's x and weight tiles take."""
    return config.num_stages * (config.block_m + config.block_n) * config.block_k * element_size


def pick_config(
    m: int,
    n: int,
    k: int,
    num_sms: int,
    smem_limit: int | None = None,
    element_size: int = 2,
    options: LinearOptions = _DEFAULT,
) -> LinearConfig | None:
    """The launch for `m` rows of a `[n, k]` weight, or None where cuBLAS is the better choice: more
    than `options.max_rows` rows, or an output wide enough that cuBLAS's tiles fill the GPU. Splits: the
    fewest (a power of two) that bring the programs to 90% of the SMs, each at least `min_split_k`
    deep. On a GPU with less shared memory than the tiles need (`smem_limit`, bytes a program may
    use) the pipeline gets fewer stages, then shallower K tiles."""
    o = options
    tiles = triton.cdiv(n, o.block_n)
    if not 1 <= m <= o.max_rows or tiles >= o.narrow_tiles_per_sm * num_sms:
        return None
    splits = 1
    while tiles * splits < 0.9 * num_sms and k // (splits * 2) >= o.min_split_k:
        splits *= 2
    config = LinearConfig(
        min(o.max_block_m, max(16, triton.next_power_of_2(m))), o.block_n, o.block_k, splits
    )
    if smem_limit is None:
        return config
    while shared_memory(config, element_size) > 0.9 * smem_limit:
        if config.num_stages > 2:
            config = replace(config, num_stages=config.num_stages - 1)
        elif config.block_k > 32:
            config = replace(config, block_k=config.block_k // 2)
        else:
            return None  # not even the smallest tiles fit: cuBLAS
    return config


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None = None,
    config: LinearConfig | None = None,
    workspace: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x [M, K] @ weight[N, K].T (+ bias [N]) (+ residual [M, N])` in x's dtype; `config` from `pick_config`
    (default: picked here for this device). `workspace`: a flat fp32 buffer of at least
    `splits * M * N` elements for the split partials (allocated when None)."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(
            f"linear: x has {k} features, the weight {tuple(weight.shape)} expects {weight.shape[1]}"
        )
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("linear: x and weight need contiguous rows")
    if config is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
        config = pick_config(m, n, k, sms) or LinearConfig(
            max(16, triton.next_power_of_2(min(m, _DEFAULT.max_rows))), _DEFAULT.block_n, _DEFAULT.block_k, 1
        )
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1):
        raise ValueError(
            f"linear: the residual must be [{m}, {n}] with contiguous rows, not {tuple(residual.shape)}"
        )
    res = residual if residual is not None else y
    step = triton.cdiv(triton.cdiv(k, config.splits), config.block_k) * config.block_k
    splits = triton.cdiv(k, step)
    direct = splits == 1
    if direct:
        part = y
    elif workspace is None:
        part = torch.empty(splits * m * n, device=x.device, dtype=torch.float32)
    else:
        part = workspace[: splits * m * n]
    grid = (triton.cdiv(n, config.block_n), splits, triton.cdiv(m, config.block_m))
    b = bias if bias is not None else y
    _linear_splitk[grid](
        x, weight, y, res, b, part,
        m, n, k, step,
        x.stride(0), weight.stride(0), y.stride(0), res.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        DIRECT=direct, HAS_RES=residual is not None, HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if not direct:
        block = 1024
        _sum_splits[(m, triton.cdiv(n, block))](
            part, y, res, b, m, n, y.stride(0), res.stride(0),
            SPLITS=splits, BLOCK=block, HAS_RES=residual is not None, HAS_BIAS=bias is not None,
        )  # fmt: skip
    return y
