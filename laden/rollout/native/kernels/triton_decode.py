"""laden's paged decode attention kernel (Triton): one query token per sequence, GQA, split-K.

Decode attention reads every cached key and value of every sequence once per step: it is bound
by memory bandwidth, so the kernel's job is to keep enough loads in flight to stream the cache at
full speed. One program handles one (sequence, KV head, split): the query heads that share that
KV head (padded to 16 rows so the score and value products run on tensor cores) against one range
of the sequence's pages, `tile_pages` pages (gathered through the block table) per iteration,
with an online softmax in fp32. In an unsplit launch the loads of a row's last tile skip the
tokens past its end (`DecodeOptions.mask_loads`).

Splits are ranges of `split_pages` pages, fixed per launch: a sequence uses as many as its length
needs and the programs of the others return at once. They give a small batch enough programs to
fill the GPU; once rows times KV heads fill it, one split a row is faster (measured: fixed-size
splits, meant to even out a mix of lengths, cost more in merging than they gained). With one
split per sequence the kernel writes the output directly; otherwise a second kernel merges the
used splits' partial outputs by their log-sum-exp. No host value is read, so the step is CUDA
graph safe: the grid depends only on the batch size and the table's width, the lengths come from
a tensor.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from laden.rollout.native.attention import TRITON_INTERPRETED
from laden.rollout.native.kernels.options import DecodeOptions

_DEFAULT = DecodeOptions()  # the settings' meanings and measurements: `DecodeOptions`


@triton.jit
def _paged_decode_split(
    Q, K, V, BT, LENS, OUT, LSE,
    scale,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_btb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr,
    TILE_PAGES: tl.constexpr, SPLIT_PAGES: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr,
    MASK_LOADS: tl.constexpr, HEADS_INNER: tl.constexpr, PREFETCH_TABLE: tl.constexpr, HEADS: tl.constexpr,
):  # fmt: skip
    if HEADS_INNER:
        kvh = tl.program_id(0) * HEADS  # this program's first KV head
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1) * HEADS
    split = tl.program_id(2)
    length = tl.load(LENS + b)
    n_pages = tl.cdiv(length, PAGE)
    first_page = split * SPLIT_PAGES
    if first_page >= n_pages:
        return  # this sequence needs fewer splits
    TILE: tl.constexpr = TILE_PAGES * PAGE
    # a tile's entries: TILE tokens of each of the program's HEADS KV heads, head after head
    offs_e = tl.arange(0, HEADS * TILE)
    tok = offs_e % TILE
    head_of_entry = offs_e // TILE
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    g_mask = offs_g < HEADS * GROUP
    heads = kvh * GROUP + offs_g  # the query heads of the program's KV heads, in order
    # each query row scores its own KV head's entries (padding rows: the last head's, never stored)
    own = tl.minimum(offs_g // GROUP, HEADS - 1)[:, None] == head_of_entry[None, :]
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=g_mask[:, None], other=0.0
    )
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    last_page = tl.minimum(first_page + SPLIT_PAGES, n_pages)
    first_tile = first_page // TILE_PAGES
    last_tile = tl.cdiv(last_page, TILE_PAGES)
    qk_scale = scale * 1.4426950408889634  # log2(e): exp2 below
    in_page = (tok % PAGE) * stride_ks + (kvh + head_of_entry) * stride_kh
    table = BT + b * stride_btb
    if PREFETCH_TABLE:  # the first tile's block numbers before the loop, each next tile's one ahead
        page = first_tile * TILE_PAGES + tok // PAGE
        blk_next = tl.load(table + page, mask=page < last_page, other=0)
    for t in range(first_tile, last_tile):
        start = t * TILE
        page = t * TILE_PAGES + tok // PAGE
        valid = ((start + tok) < length) & (page < last_page)
        # pages past this split's end (a partial last tile) point at block 0, the sink
        if PREFETCH_TABLE:
            blk = blk_next.to(tl.int64)
            ahead = page + TILE_PAGES
            blk_next = tl.load(table + ahead, mask=ahead < last_page, other=0)
        else:
            blk = tl.load(table + page, mask=page < last_page, other=0).to(tl.int64)
        rows = blk * stride_kb + in_page
        if MASK_LOADS:  # tokens past the row's end are never read (zero-filled)
            k = tl.load(
                K + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0
            )  # [HEADS*TILE, D]
            v = tl.load(V + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        else:  # read and discarded below
            k = tl.load(K + rows[:, None] + offs_d[None, :])
            v = tl.load(V + rows[:, None] + offs_d[None, :])
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_G, HEADS*TILE] fp32
        if HEADS == 1:
            s = tl.where(valid[None, :], s, float("-inf"))
        else:
            s = tl.where(valid[None, :] & own, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]  # every used split holds at least one valid token
    if DIRECT:
        o_ptr = OUT + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=g_mask[:, None])
    else:
        o_ptr = OUT + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
        tl.store(o_ptr, out, mask=g_mask[:, None])
        tl.store(
            LSE + b * stride_lb + heads * stride_lh + split, m_i + tl.log2(l_i), mask=g_mask
        )  # log2 units


@triton.jit
def _merge_splits(
    PART, LSE, LENS, OUT,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    SPLIT_TOKENS: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    used = tl.cdiv(tl.load(LENS + b), SPLIT_TOKENS)  # the splits this sequence wrote
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    s_mask = offs_s < used
    lse = tl.load(LSE + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - m)  # 0 for the unused splits
    part = tl.load(
        PART + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=s_mask[:, None], other=0.0,
    )  # fmt: skip
    out = tl.sum(part * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty))


@functools.cache
def shared_memory_limit(device_index: int) -> int | None:
    """Bytes of shared memory one program may opt into on this GPU (None: not reported)."""
    props = torch.cuda.get_device_properties(device_index)
    return getattr(props, "shared_memory_per_block_optin", None)


def tile_tokens_for(
    head_dim: int,
    element_size: int,
    num_stages: int,
    page: int,
    smem_limit: int | None,
    tile_tokens: int = _DEFAULT.tile_tokens,
) -> int:
    """Tokens per iteration: `tile_tokens` (half in fp32, whose tiles take twice the room), halved
    while the pipeline's key and value tiles would not fit 90% of `smem_limit` (GPUs with less
    shared memory than an H200's 227 KB), never below one page."""
    tile = tile_tokens if element_size <= 2 else tile_tokens // 2
    if smem_limit is not None:
        while tile > page and num_stages * 2 * tile * head_dim * element_size > 0.9 * smem_limit:
            tile //= 2
    return max(tile, page)


def split_pages_for(
    batch: int, kv_heads: int, max_pages: int, page: int, num_sms: int, options: DecodeOptions = _DEFAULT
) -> int | None:
    """Pages per split for a launch of `batch` rows whose tables hold `max_pages` pages; None (one
    split a row) when the rows alone make enough programs. Otherwise splits of `split_tokens`
    (more when the table would need more than `max_splits`), a whole number of tiles each: a
    row uses as many as its length needs, so short rows stay one program."""
    if batch * kv_heads >= options.unsplit_programs_per_sm * num_sms:
        return None
    tile = max(1, options.tile_tokens // page)
    pages = max(options.split_tokens // page, -(-max_pages // options.max_splits), 1)
    return -(-pages // tile) * tile


def workspace_rows(
    batch: int, kv_heads: int, max_pages: int, page: int, num_sms: int, options: DecodeOptions = _DEFAULT
) -> int:
    """Split rows (`batch x splits`) a launch of `batch` rows writes (sizes a graph's workspace);
    0 when it writes its output directly."""
    split = split_pages_for(batch, kv_heads, max_pages, page, num_sms, options)
    return 0 if split is None else batch * -(-max_pages // split)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    split_pages: int | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    tile_tokens: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    mask_loads: bool | None = None,
    heads_inner: bool | None = None,
    prefetch_table: bool | None = None,
    heads_per_program: int | None = None,
    max_registers: int | None = None,
    options: DecodeOptions = _DEFAULT,
) -> torch.Tensor:
    """q `[B, Hq, D]`, caches `[NB, PAGE, Hkv, D]`, block_tables `[B, MB]` int32, context_lens `[B]`
    int32 (every length >= 1) -> `[B, Hq, D]` in q's dtype.

    `split_pages`: pages per split (None: one split for the whole table); it is rounded up to a
    whole number of tiles. `workspace`: preallocated flat fp32 buffers `(partials, lse)` of at
    least `B * splits * Hq * D` and `B * splits * Hq` elements (a CUDA graph keeps its own).
    `num_warps` / `num_stages` / `mask_loads` / `heads_inner` / `prefetch_table` /
    `heads_per_program` / `max_registers`: see `DecodeOptions` (None: `options`' value);
    `tile_tokens` counts the tokens of one KV head an iteration reads (None: `options.tile_tokens`,
    fitted to the GPU's shared memory)."""
    b, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    group = hq // hkv
    max_pages = block_tables.shape[1]
    num_warps = options.num_warps if num_warps is None else num_warps
    num_stages = options.num_stages if num_stages is None else num_stages
    heads = options.heads_per_program if heads_per_program is None else heads_per_program
    if heads not in (1, 2) or hkv % heads:
        raise ValueError(f"heads_per_program={heads} must be 1 or 2 and divide the {hkv} KV heads")
    if tile_tokens is None:
        limit = None
        if q.is_cuda:
            limit = shared_memory_limit(
                q.device.index if q.device.index is not None else torch.cuda.current_device()
            )
        # the same entries an iteration (and shared memory) as one head's tile
        tile_tokens = max(
            page, tile_tokens_for(d, q.element_size(), num_stages, page, limit, options.tile_tokens) // heads
        )
    tile_pages = max(1, tile_tokens // page)
    split = max_pages if split_pages is None else max(1, min(split_pages, max_pages))
    split = -(-split // tile_pages) * tile_pages
    splits = -(-max_pages // split)
    out = torch.empty_like(q)
    if splits == 1:
        part, lse = out, out  # the kernel writes `out` itself (lse unused)
        strides = (out.stride(0), out.stride(1), 0, 0, 0)
    else:
        if workspace is None:
            part = torch.empty(b, hq, splits, d, device=q.device, dtype=torch.float32)
            lse = torch.empty(b, hq, splits, device=q.device, dtype=torch.float32)
        else:
            part = workspace[0][: b * hq * splits * d].view(b, hq, splits, d)
            lse = workspace[1][: b * hq * splits].view(b, hq, splits)
        strides = (part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1))
    if mask_loads is None:
        mask_loads = options.mask_loads if options.mask_loads is not None else splits == 1
    heads_inner = options.heads_inner if heads_inner is None else heads_inner
    prefetch_table = options.prefetch_table if prefetch_table is None else prefetch_table
    programs = hkv // heads
    registers = options.max_registers if max_registers is None else max_registers
    launch = {} if not registers or TRITON_INTERPRETED else {"maxnreg": registers}  # 0: no cap
    _paged_decode_split[(programs, b, splits) if heads_inner else (b, programs, splits)](
        q, k_cache, v_cache, block_tables, context_lens, part, lse,
        scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        *strides,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(heads * group)), PAGE=page, D=d,
        TILE_PAGES=tile_pages, SPLIT_PAGES=split, DIRECT=splits == 1, MASK_LOADS=mask_loads,
        HEADS_INNER=heads_inner, PREFETCH_TABLE=prefetch_table, HEADS=heads,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages, **launch,
    )  # fmt: skip
    if splits > 1:
        _merge_splits[(b, hq)](
            part, lse, context_lens, out,
            part.stride(0), part.stride(1), part.stride(2),
            lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            SPLIT_TOKENS=split * page, BLOCK_S=max(2, triton.next_power_of_2(splits)), D=d,
        )  # fmt: skip
    return out
