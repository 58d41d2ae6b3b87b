"""laden's fused q/k/v epilogue (Triton): Qwen3's per-head q/k RMSNorm, rotary embedding, KV cache writes.

Between one decoder layer's fused q/k/v projection and its attention sit a handful of small,
memory-bound steps: split the projection into q, k and v heads, RMS-normalise every q and k head
(Qwen3; Llama and Qwen2 have no such norm), rotate q and k by their token's position, and write
the new keys and values into their paged cache slots. As separate PyTorch ops that is about six
kernels per layer, each reading and writing the whole activation; 28 layers a step, every decode
step, inside CUDA graphs, where the cost is launches and round trips to memory rather than
arithmetic. `rope_store` does it in one launch that reads the projection once and writes each
result once: the rotated q (returned for attention) and the keys and values (into the caches).

One program handles one token and one block of `BLOCK_H` consecutive heads of the projection's
row, which holds the token's `nh` q heads, then `nkv` k heads, then `nkv` v heads: a
`[BLOCK_H, D]` tile (about `QKVOptions.tile_elements` values) in which each row knows which kind of head it
is. q and k rows are normalised in fp32 (the statistics of one head are its own row) and rotated;
`rotate_half`'s partner of element `d` is element `(d + D/2) % D` of the same row, negated in the
first half, so it is a second, permuted load of the row (from L1) rather than a shuffle. v rows
are copied unchanged. Each kind is then stored to its destination under its own row mask: q to
the output, k and v to `slot * nkv * D` of their caches, in int64 offsets (a cache can hold more
than 2**31 elements).

Rounding follows Hugging Face's modules where it is cheap to: the normalised head is rounded to
the input dtype before the weight is applied, and the weighted result rounded again (exactly
what `weight * x.to(dtype)` does); the rotation is computed in fp32 from those values and rounded
once, where PyTorch rounds each product and the sum, so bf16 results agree within a unit or two
in the last place. No host value is read and the grid depends only on the shapes (tokens x head
blocks), so the launch is CUDA graph safe; every slot must be a valid slot of the caches (padding
rows of a graph point at a sink block, as elsewhere in the engine).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from laden.rollout.native.kernels.options import QKVOptions

_DEFAULT = QKVOptions()  # the settings' meanings: `QKVOptions`


@triton.jit
def _rope_store(
    QKV, POS, COS, SIN, QW, KW, KC, VC, SLOTS, QOUT,
    eps,
    stride_qkv, stride_cos, stride_sin,
    NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
    HAS_NORM: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = D // 2
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    partner = (offs_d + HALF) % D  # rotate_half(x)[d] = sign[d] * x[partner[d]]
    is_q = (offs_h < NH)[:, None]
    is_k = ((offs_h >= NH) & (offs_h < NH + NKV))[:, None]
    is_v = ((offs_h >= NH + NKV) & (offs_h < NH + 2 * NKV))[:, None]
    is_qk = is_q | is_k
    row = offs_h[:, None] * D  # each head's offset in the token's row (and in q's)
    x = tl.load(QKV + t * stride_qkv + row + offs_d[None, :], mask=is_qk | is_v, other=0.0)  # [BLOCK_H, D]
    x2 = tl.load(QKV + t * stride_qkv + row + partner[None, :], mask=is_qk, other=0.0)  # permuted
    dtype = x.dtype
    xf = x.to(tl.float32)
    x2f = x2.to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]  # one per head
        w = tl.where(is_q, tl.load(QW + offs_d)[None, :], tl.load(KW + offs_d)[None, :]).to(tl.float32)
        w2 = tl.where(is_q, tl.load(QW + partner)[None, :], tl.load(KW + partner)[None, :]).to(tl.float32)
        xf = (w * (xf * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2f = (w2 * (x2f * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    pos = tl.load(POS + t)
    c = tl.load(COS + pos * stride_cos + offs_d).to(tl.float32)
    s = tl.load(SIN + pos * stride_sin + offs_d).to(tl.float32)
    s = tl.where(offs_d < HALF, -s, s)
    y = (xf * c[None, :] + x2f * s[None, :]).to(dtype)
    out = row + offs_d[None, :]
    tl.store(QOUT + t * (NH * D) + out, y, mask=is_q)
    slot = tl.load(SLOTS + t).to(tl.int64) * (NKV * D)
    tl.store(KC + (slot - NH * D) + out, y, mask=is_k)
    tl.store(VC + (slot - (NH + NKV) * D) + out, x, mask=is_v)


def rope_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_w: torch.Tensor | None,
    k_norm_w: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    nh: int,
    nkv: int,
    *,
    block_heads: int | None = None,
    tile_elements: int = _DEFAULT.tile_elements,
    num_warps: int = _DEFAULT.num_warps,
) -> torch.Tensor:
    """qkv `[N, (nh + 2 * nkv) * D]` (one fused projection, rows of stride-1 elements), positions
    `[N]`, cos/sin `[L, D]` tables (Hugging Face's `rotate_half` convention), q/k norm weights
    `[D]` or both None, caches `[NB, PAGE, nkv, D]` contiguous, slots `[N]` (flat `block * PAGE +
    offset`) -> q `[N, nh, D]` in qkv's dtype, normalised (with weights) and rotated.

    Writes each token's normalised, rotated k heads and its v heads into `slots` of the caches;
    every other slot is left as it was. D must be a power of two >= 16. `block_heads`: heads per
    program, a power of two (None: `tile_elements // D`, at most all of them)."""
    d = cos.shape[-1]
    heads = nh + 2 * nkv
    if d < 16 or d & (d - 1):
        raise ValueError(f"head dim must be a power of two >= 16, got {d}")
    if nh < 1 or nkv < 1:
        raise ValueError(f"need at least one q and one kv head, got nh={nh}, nkv={nkv}")
    if qkv.dim() != 2 or qkv.shape[1] != heads * d or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [N, {heads * d}] with unit column stride, got {tuple(qkv.shape)}")
    n = qkv.shape[0]
    if positions.shape != (n,) or slots.shape != (n,):
        raise ValueError(
            f"positions and slots must be [{n}], got {tuple(positions.shape)}, {tuple(slots.shape)}"
        )
    if sin.shape != cos.shape or cos.dim() != 2 or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError(
            f"cos and sin must be equal [L, D] tables, got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    for cache in (k_cache, v_cache):
        if cache.dim() != 4 or cache.shape[2:] != (nkv, d) or not cache.is_contiguous():
            raise ValueError(f"caches must be contiguous [NB, PAGE, {nkv}, {d}], got {tuple(cache.shape)}")
        if cache.dtype != qkv.dtype:
            raise ValueError(f"caches must have qkv's dtype {qkv.dtype}, got {cache.dtype}")
    if (q_norm_w is None) != (k_norm_w is None):
        raise ValueError("q_norm_w and k_norm_w must be given together")
    if q_norm_w is not None and k_norm_w is not None:
        if (
            q_norm_w.shape != (d,)
            or k_norm_w.shape != (d,)
            or q_norm_w.stride(0) != 1
            or k_norm_w.stride(0) != 1
        ):
            raise ValueError(f"q/k norm weights must be [{d}] with unit stride")
        qw, kw = q_norm_w, k_norm_w
    else:
        qw = kw = qkv  # unused (HAS_NORM=False)
    q = torch.empty(n, nh, d, device=qkv.device, dtype=qkv.dtype)
    if n == 0:
        return q
    block_h = block_heads or min(triton.next_power_of_2(heads), max(1, tile_elements // d))
    if block_h & (block_h - 1):
        raise ValueError(f"block_heads must be a power of two, got {block_h}")
    _rope_store[(n, triton.cdiv(heads, block_h))](
        qkv, positions, cos, sin, qw, kw, k_cache, v_cache, slots, q,
        float(eps),
        qkv.stride(0), cos.stride(0), sin.stride(0),
        NH=nh, NKV=nkv, D=d, BLOCK_H=block_h, HAS_NORM=q_norm_w is not None,
        num_warps=max(1, min(num_warps, block_h * d // 256)),
    )  # fmt: skip
    return q
