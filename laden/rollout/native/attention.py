"""Attention over a paged KV cache: prefill (causal, packed prompts) and decode (one query per sequence).

The cache of one layer is two tensors `[num_blocks, block_size, kv_heads, head_dim]`; a sequence
owns a list of blocks (its row of `block_tables`), and token `p` of it lives in slot
`block_tables[p // block_size] * block_size + p % block_size`. Block 0 is never handed to a
sequence: padding entries of `block_tables` point at it, so a write past a sequence's blocks
(a padded batch row, or a token decoded after the sequence stopped) lands there and corrupts
nothing.

Prefill always starts a sequence at position 0 (a resumed or re-queued sequence re-prefills its
prompt and the tokens it has), so its attention is causal within the packed new tokens and reads
nothing from the cache: `varlen_attn` on CUDA, one SDPA call per prompt elsewhere.

Decode has three implementations, chosen once per engine (`decode_backend`):
- `triton`: laden's paged decode kernel (`laden.rollout.native.kernels.triton_decode`), CUDA graph safe;
- `varlen`: torch's flash `varlen_attn` with `block_table` (torch builds that have it);
- `torch`: gathers each sequence's keys and values into a padded batch and runs SDPA with a
  length mask: the reference, for the CPU and for tests.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Literal

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # torch < 2.10
    _varlen_attn = None  # type: ignore[assignment]

DecodeBackend = Literal["triton", "varlen", "torch"]
_VARLEN_PARAMS = (
    frozenset(inspect.signature(_varlen_attn).parameters) if _varlen_attn is not None else frozenset()
)
PAGED_VARLEN = "block_table" in _VARLEN_PARAMS and "seqused_k" in _VARLEN_PARAMS


# Triton's interpreter (`TRITON_INTERPRET=1`, read when Triton is imported): the kernels run on the
# CPU, with no fast-math intrinsics and no register caps.
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def pick_decode_backend(device: torch.device, dtype: torch.dtype, requested: str = "auto") -> DecodeBackend:
    """`auto`: Triton on CUDA when importable, else torch's paged varlen kernel, else the reference."""
    if requested in ("triton", "varlen", "torch"):
        if requested != "torch" and device.type != "cuda":
            raise ValueError(f"decode_backend={requested!r} needs a CUDA device, the engine runs on {device}")
        if requested == "varlen" and not PAGED_VARLEN:
            raise ValueError(
                f"decode_backend='varlen' needs a torch whose varlen_attn takes block_table ({torch.__version__} does not)"
            )
        return requested  # type: ignore[return-value]
    if requested != "auto":
        raise ValueError(f"decode_backend={requested!r}: expected auto, triton, varlen or torch")
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        if triton_available():
            return "triton"
        if PAGED_VARLEN:
            return "varlen"
    return "torch"


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bounds: list[int],
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention within each packed prompt. q `[N, Hq, D]`, k/v `[N, Hkv, D]` -> `[N, Hq, D]`.

    `cu_seqlens` (int32, on q's device) and `bounds` (the same offsets as a host list) delimit the
    prompts; the host list saves a sync where one SDPA call per prompt runs."""
    gqa = q.shape[1] != k.shape[1]
    if _varlen_attn is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        kwargs: dict[str, Any] = {"enable_gqa": True} if gqa and "enable_gqa" in _VARLEN_PARAMS else {}
        if gqa and not kwargs:
            # this torch's varlen_attn refuses fewer key heads; its flash kernel takes them (the
            # repeated keys and values were two copies a layer: 39 ms of workload B's prefills)
            try:
                return torch.ops.aten._flash_attention_forward(
                    q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True, False, scale=scale
                )[0]
            except RuntimeError:
                rep = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return _varlen_attn(  # type: ignore[return-value]
            q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale, window_size=(-1, 0), **kwargs
        )
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        qd, kd, vd = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))  # [1, H, L, D]
        out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=gqa)
        pieces.append(out[0].transpose(0, 1))
    return torch.cat(pieces, dim=0)


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference paged decode. q `[B, Hq, D]`; caches `[NB, BS, Hkv, D]`; block_tables `[B, MB]`
    int32; context_lens `[B]` (tokens to attend to, the new one included) -> `[B, Hq, D]`.

    Gathers all `MB * BS` slots of every row and masks those at or past the row's length (no
    host sync, so it also runs inside a CUDA graph, slowly)."""
    b, hq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    mb = block_tables.shape[1]
    idx = block_tables.long()
    keys = k_cache[idx].reshape(b, mb * bs, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]
    values = v_cache[idx].reshape(b, mb * bs, hkv, d).transpose(1, 2)
    pos = torch.arange(mb * bs, device=q.device)
    mask = pos[None, :] < context_lens[:, None].to(pos.dtype)  # [B, L]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], keys, values, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=hq != hkv
    )
    return out[:, :, 0, :]


def decode_attention_varlen(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    cu_q: torch.Tensor,
    max_k: int,
) -> torch.Tensor:
    """torch's flash kernel with a block table (one query per sequence; `cu_q` = arange(B + 1))."""
    assert _varlen_attn is not None
    kwargs: dict[str, Any] = {"enable_gqa": True} if q.shape[1] != k_cache.shape[2] else {}
    return _varlen_attn(  # type: ignore[return-value]
        q, k_cache, v_cache, cu_q, None, 1, max_k, scale=scale, window_size=(-1, 0),
        seqused_k=context_lens.to(torch.int32), block_table=block_tables, **kwargs,
    )  # fmt: skip
