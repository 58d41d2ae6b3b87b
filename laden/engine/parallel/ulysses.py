"""Ulysses context parallel (`c`): shard a packed row over ranks, all-to-all around attention.

Each of the `c` ranks of a context-parallel group holds a contiguous `1/c` slice of the
packed micro-batch (tokens, positions, labels); everything but attention is per token and
runs on the slice. Around attention two all-to-alls swap the split: before it, each rank
sends its tokens of every head group and receives all tokens of `H/c` heads
(`[1, H, T/c, D] -> [1, H/c, T, D]`), so attention runs over the *whole* packed row with the
row's full `cu_seqlens` (documents that straddle a slice boundary are handled because the
kernel sees every token); after it the reverse all-to-all returns the row slice with all
heads. RoPE is applied before the exchange with each token's true position id, which is
why the slice keeps the global `position_ids`.

KV heads: with `kv % c == 0` they are split like query heads; with `c % kv == 0` each KV
head is repeated `c / kv` times first so every rank receives the one KV head its query
heads use. Cost: four all-to-alls of the q/k/v/output activations per layer (each moves
`(c-1)/c` of the attention inputs), in exchange for activations and attention work that
scale as `1/c` per rank.

The row is padded to a multiple of `c` with a padding document (ignored labels, its own
`cu_seqlens` entry), so the padding never attends to or from real tokens. Per-token fields
(loss weights, advantages, old log-probs) are padded with 0 and sliced like the labels
(`shard_batch`), so an objective reads them next to the rank's labels. Per-token outputs of
a gradient-free forward come back as slices and are all-gathered into whole rows
(`gather_row`: one all-gather of `[T]` per output and micro-batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from laden.data.batch import PackedBatch

IGNORE_INDEX = -100


class _AllToAll(torch.autograd.Function):
    """Split `x` on `scatter_dim` across ranks, concatenate what arrives on `gather_dim`."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.meta = (scatter_dim, gather_dim, group)
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim, group = ctx.meta
        return _all_to_all(grad, gather_dim, scatter_dim, group), None, None, None


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    chunks = [c.contiguous() for c in x.chunk(world, dim=scatter_dim)]
    send = torch.stack(chunks)  # [c, *chunk_shape]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """`[B, H, T/c, D]` on each rank -> `[B, H/c, T, D]` (heads scattered, sequence gathered)."""
    return _AllToAll.apply(x, 1, 2, group)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """`[B, T, H/c, D]` attention output -> `[B, T/c, H, D]` (sequence scattered, heads gathered)."""
    return _AllToAll.apply(x, 1, 2, group)


def check_cp_heads(num_heads: int, num_kv_heads: int, cp: int) -> None:
    """ValueError unless `cp` divides the heads and divides or is a multiple of the KV heads."""
    if num_heads % cp or (num_kv_heads % cp and cp % num_kv_heads):
        raise ValueError(
            f"actor.backend: context parallel size c{cp} must divide num_attention_heads={num_heads} and "
            f"either divide or be a multiple of num_key_value_heads={num_kv_heads}; pick another c"
        )


def ulysses_attention(inner: Callable, group: dist.ProcessGroup) -> Callable:
    """Wrap a Hugging Face attention function (`fn(module, q, k, v, mask, **kw)`) with Ulysses all-to-alls.

    `q [B, H, T/c, D]`, `k`/`v [B, KV, T/c, D]` arrive sliced on the sequence; the wrapped
    function calls `inner` on `[B, H/c, T, D]` with no mask (the packed kernel separates the
    documents through the full-row `cu_seqlens` in `kw`) and returns `[B, T/c, H, D]`.
    """
    cp = dist.get_world_size(group)

    def attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
        num_heads, num_kv = query.shape[1], key.shape[1]
        check_cp_heads(num_heads, num_kv, cp)
        if num_kv % cp:
            # Repeat each KV head so that rank r receives the head of its query heads.
            key = key.repeat_interleave(cp // num_kv, dim=1)
            value = value.repeat_interleave(cp // num_kv, dim=1)
        q, k, v = (seq_to_heads(t, group) for t in (query, key, value))
        saved_groups = getattr(module, "num_key_value_groups", None)
        setattr(module, "num_key_value_groups", q.shape[1] // k.shape[1])  # noqa: B010 - typed nn.Module
        try:
            out, weights = inner(module, q, k, v, None, **kwargs)  # out [B, T, H/c, D]
        finally:
            if saved_groups is not None:
                setattr(module, "num_key_value_groups", saved_groups)  # noqa: B010
        return heads_to_seq(out, group), weights

    return attention


@dataclass(kw_only=True, slots=True)
class RowShard:
    """One rank's slice of a packed row plus the full row's document boundaries."""

    input_ids: torch.Tensor  # [T/c]
    position_ids: torch.Tensor  # [T/c], the tokens' positions in their documents
    labels: torch.Tensor  # [T/c]
    cu_seqlens: torch.Tensor  # [D + 1] int32, of the whole padded row
    max_seqlen: int
    fields: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [T/c], sliced like labels


def shard_packed_row(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    labels: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    cp_rank: int,
    cp_size: int,
    fields: dict[str, torch.Tensor] | None = None,
) -> RowShard:
    """Pad the row to a multiple of `cp_size` (one padding document) and take slice `cp_rank`.

    `fields` (per-token tensors laid out like `labels`) are padded with 0 and sliced the same way.
    """
    num_tokens = input_ids.shape[0]
    num_pad = -num_tokens % cp_size
    fields = dict(fields or {})
    if num_pad:
        input_ids = torch.cat([input_ids, input_ids.new_zeros(num_pad)])
        position_ids = torch.cat([position_ids, torch.arange(num_pad, device=position_ids.device)])
        labels = torch.cat([labels, labels.new_full((num_pad,), IGNORE_INDEX)])
        fields = {k: torch.cat([v, v.new_zeros((num_pad, *v.shape[1:]))]) for k, v in fields.items()}
        end = cu_seqlens.new_full((1,), num_tokens + num_pad)
        cu_seqlens = torch.cat([cu_seqlens, end])
        max_seqlen = max(max_seqlen, num_pad)
    size = (num_tokens + num_pad) // cp_size
    piece = slice(cp_rank * size, (cp_rank + 1) * size)
    return RowShard(
        input_ids=input_ids[piece],
        position_ids=position_ids[piece],
        labels=labels[piece],
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        fields={k: v[piece] for k, v in fields.items()},
    )


def shard_batch(batch: PackedBatch, *, cp_rank: int, cp_size: int) -> PackedBatch:
    """`batch` as context-parallel rank `cp_rank` sees it: its slice of the tokens, labels and fields,
    the full padded row's `cu_seqlens` / `max_seqlen`; `num_loss_tokens` and `seqlens` stay the
    whole row's (they describe the micro-batch, not the slice)."""
    shard = shard_packed_row(
        batch.input_ids,
        batch.position_ids,
        batch.labels,
        batch.cu_seqlens,
        batch.max_seqlen,
        cp_rank=cp_rank,
        cp_size=cp_size,
        fields=batch.fields,
    )
    return replace(
        batch,
        input_ids=shard.input_ids,
        position_ids=shard.position_ids,
        labels=shard.labels,
        cu_seqlens=shard.cu_seqlens,
        max_seqlen=shard.max_seqlen,
        fields=shard.fields,
    )


def gather_row(values: torch.Tensor, group: dist.ProcessGroup, num_tokens: int) -> torch.Tensor:
    """The inverse of the slicing: every rank's `[T/c, ...]` slice -> the full `[T, ...]` row, padding
    dropped (an all-gather over `group`; every rank of it gets the row)."""
    pieces = [torch.empty_like(values) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, values.contiguous(), group=group)
    return torch.cat(pieces)[:num_tokens]


ULYSSES_ATTENTION = "laden_ulysses"
"""Name under which the Ulysses-wrapped packed attention is registered with transformers."""


def enable_ulysses(model: Any, group: dist.ProcessGroup) -> str:
    """Switch `model` to packed varlen attention wrapped in Ulysses all-to-alls over `group`.

    The inner kernel is always `laden_varlen`: after the exchange each rank attends over the
    whole packed row, which only a kernel driven by `cu_seqlens` can keep per document.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    from laden.model.attention import LADEN_VARLEN, register_packed_attention, varlen_attention_forward

    register_packed_attention()
    AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention(varlen_attention_forward, group))
    AttentionMaskInterface.register(ULYSSES_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS[LADEN_VARLEN])
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(ULYSSES_ATTENTION)
    else:
        model.config._attn_implementation = ULYSSES_ATTENTION
    return ULYSSES_ATTENTION
