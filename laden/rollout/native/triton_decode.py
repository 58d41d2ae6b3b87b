"""laden's paged decode attention kernel (Triton): one query token per sequence, GQA, split-K.

Decode attention reads every cached key and value of every sequence once per step: it is bound
by memory bandwidth, so the kernel's job is to stream the cache at full speed. One program
handles one (sequence, KV head, split): the query heads that share that KV head (padded to 16
rows so the score and value products run on tensor cores) against one contiguous range of the
sequence's cache pages, with an online softmax in fp32. With few sequences the context is cut
into `num_splits` ranges so the GPU has enough programs; a second kernel merges the splits'
partial outputs by their log-sum-exp. No host value is read, so the step is CUDA graph safe:
the grid depends only on the batch size and `num_splits`, the lengths come from a tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_split(
    Q, K, V, BT, LENS, OUT, LSE,
    scale,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_btb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(LENS + b)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, PAGE)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=g_mask[:, None], other=0.0
    )
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    n_pages = tl.cdiv(length, PAGE)
    per_split = tl.cdiv(n_pages, SPLITS)  # this sequence's pages, cut evenly into the splits
    first_page = split * per_split
    last_page = tl.minimum(first_page + per_split, n_pages)
    qk_scale = scale * 1.4426950408889634  # log2(e): exp2 below
    for page in range(first_page, last_page):
        start = page * PAGE
        blk = tl.load(BT + b * stride_btb + page).to(tl.int64)
        base = blk * stride_kb + kvh * stride_kh
        k = tl.load(K + base + offs_n[:, None] * stride_ks + offs_d[None, :])  # [PAGE, D]
        v = tl.load(V + base + offs_n[:, None] * stride_ks + offs_d[None, :])
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_G, PAGE] fp32
        valid = (start + offs_n) < length
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))  # log2 units
    o_ptr = OUT + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(o_ptr, out, mask=g_mask[:, None])
    tl.store(LSE + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _merge_splits(
    PART, LSE, OUT,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    s_mask = offs_s < SPLITS
    lse = tl.load(LSE + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # 0 for empty splits
    part = tl.load(
        PART + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=s_mask[:, None], other=0.0,
    )  # fmt: skip
    total = tl.sum(w, axis=0)
    out = tl.sum(part * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty))


def num_splits_for(batch: int, kv_heads: int, max_pages: int, num_sms: int) -> int:
    """Splits per sequence so that about two waves of programs fill the GPU (at most one page each)."""
    want = max(1, (2 * num_sms + batch * kv_heads - 1) // (batch * kv_heads))
    return int(min(want, 16, max_pages))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q `[B, Hq, D]`, caches `[NB, PAGE, Hkv, D]`, block_tables `[B, MB]` int32, context_lens `[B]`
    int32 -> `[B, Hq, D]` in q's dtype. `workspace`: preallocated `(partials [B, Hq, S, D] fp32,
    lse [B, Hq, S] fp32)` (a CUDA graph keeps its own)."""
    b, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    group = hq // hkv
    max_pages = block_tables.shape[1]
    splits = max(1, min(num_splits, max_pages))
    if workspace is None:
        part = torch.empty(b, hq, splits, d, device=q.device, dtype=torch.float32)
        lse = torch.empty(b, hq, splits, device=q.device, dtype=torch.float32)
    else:
        part, lse = workspace[0][:b, :, :splits], workspace[1][:b, :, :splits]
    _paged_decode_split[(b, hkv, splits)](
        q, k_cache, v_cache, block_tables, context_lens, part, lse,
        scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), PAGE=page, D=d, SPLITS=splits,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2,
    )  # fmt: skip
    out = torch.empty_like(q)
    _merge_splits[(b, hq)](
        part, lse, out,
        part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        SPLITS=splits, BLOCK_S=max(2, triton.next_power_of_2(splits)), D=d,
    )  # fmt: skip
    return out
