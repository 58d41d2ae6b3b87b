"""Padding-free packed batches: documents concatenated into one `[T]` row, split by `cu_seqlens`.

A micro-batch is one flat sequence of its documents instead of a `[B, L]` rectangle, so
no FLOPs or activation memory go to padding; attention kernels keep documents apart
through `cu_seqlens` (varlen) or through `position_ids` restarting at 0. Labels are
shifted within each document on the host, so the loss needs no cross-document masking.

Label layout, exactly: a document with tokens x_0..x_{n-1} and loss mask m_0..m_{n-1}
gets label x_{j+1} at position j if m_{j+1} == 1, else -100; its last position gets -100.
`num_loss_tokens` (labels != -100) is counted here, on the host, so the training loop
can normalise the loss without a device sync.

Per-token fields (`fields`: loss weights, advantages, old and reference log-probabilities of
RL) ride beside the labels, in the labels' layout: the value at position j belongs to the
token that position j predicts (token j+1 of its document), so a field given per input token
is shifted exactly like the labels (`pack_samples(..., fields=...)`), and its value is 0 where
the label is -100. An objective reads `batch.fields[name][j]` next to `batch.labels[j]`. The cost is a host pass over the tokens per
micro-batch, small next to the forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

IGNORE_INDEX = -100


@dataclass(slots=True)
class PackedBatch:
    """One padding-free micro-batch; `seqlens` lists the real documents, padding excluded."""

    input_ids: torch.Tensor  # [T] long
    position_ids: torch.Tensor  # [T] long, restarting at 0 for each document
    labels: torch.Tensor  # [T] long, next-token targets within each document, -100 where no loss
    cu_seqlens: torch.Tensor  # [D + 1] int32, document boundaries; D counts a padding document
    max_seqlen: int
    num_loss_tokens: int
    seqlens: list[int]
    fields: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [T], laid out like labels

    @property
    def num_tokens(self) -> int:
        """T, padding included."""
        return self.input_ids.shape[0]

    @property
    def num_padding_tokens(self) -> int:
        """Tokens of the padding document appended for `pad_to_multiple_of` (0 if none)."""
        return self.num_tokens - sum(self.seqlens)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """A copy with all tensors on `device` (asynchronous from pinned memory with `non_blocking`)."""
        return replace(
            self,
            input_ids=self.input_ids.to(device, non_blocking=non_blocking),
            position_ids=self.position_ids.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            cu_seqlens=self.cu_seqlens.to(device, non_blocking=non_blocking),
            fields={k: v.to(device, non_blocking=non_blocking) for k, v in self.fields.items()},
        )

    def pin_memory(self) -> PackedBatch:
        """A copy in page-locked host memory, for asynchronous host-to-device copies."""
        return replace(
            self,
            input_ids=self.input_ids.pin_memory(),
            position_ids=self.position_ids.pin_memory(),
            labels=self.labels.pin_memory(),
            cu_seqlens=self.cu_seqlens.pin_memory(),
            fields={k: v.pin_memory() for k, v in self.fields.items()},
        )

    def with_fields(self, **fields: torch.Tensor) -> PackedBatch:
        """A copy with these per-token fields added (each `[T]`, laid out like `labels`)."""
        for name, value in fields.items():
            if value.shape != self.labels.shape:
                raise ValueError(
                    f"field {name!r} has shape {tuple(value.shape)}; per-token fields must be [T] = "
                    f"[{self.num_tokens}], laid out like labels"
                )
        return replace(self, fields={**self.fields, **fields})


def split_documents(batch: PackedBatch) -> list[PackedBatch]:
    """The batch as two batches of whole documents (cut at the boundary nearest half the tokens), with the same
    tokens, labels and per-token fields: a loss summed over them equals the batch's. One document
    (or one and the padding): `[batch]`. Counts its loss tokens from the labels (one device sync)."""
    lengths = list(batch.seqlens)
    if len(lengths) < 2:
        return [batch]
    prefix = [sum(lengths[:i]) for i in range(1, len(lengths))]  # tokens before each possible cut
    k = min(range(1, len(lengths)), key=lambda i: (abs(2 * prefix[i - 1] - batch.num_tokens), i))
    total = prefix[k - 1]
    padding = batch.num_padding_tokens
    parts = []
    for docs, lo, hi, pad in ((lengths[:k], 0, total, 0), (lengths[k:], total, batch.num_tokens, padding)):
        bounds = [0]
        for n in [*docs, *([pad] if pad else [])]:
            bounds.append(bounds[-1] + n)
        labels = batch.labels[lo:hi]
        parts.append(
            PackedBatch(
                input_ids=batch.input_ids[lo:hi],
                position_ids=batch.position_ids[lo:hi],
                labels=labels,
                cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=batch.cu_seqlens.device),
                max_seqlen=max([*docs, pad]),
                num_loss_tokens=int((labels != -100).sum()),
                seqlens=docs,
                fields={name: value[lo:hi] for name, value in batch.fields.items()},
            )  # fmt: skip
        )
    return parts


def pack_samples(
    samples: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    pad_to_multiple_of: int | None = None,
    pad_token_id: int = 0,
    fields: dict[str, Sequence[Sequence[float]]] | None = None,
) -> PackedBatch:
    """Concatenate `(input_ids, loss_mask)` samples into one padding-free batch.

    With `pad_to_multiple_of`, one padding document (labels -100, positions from 0) is
    appended so that T is a multiple of it; the loss and `num_loss_tokens` do not change.
    `fields`: per-token values given per sample and per input token (`fields[name][i][t]`
    belongs to token t of sample i), packed as fp32 `[T]` in the labels' layout (shifted by
    one within each document, 0 where the label is -100).
    """
    if not samples:
        raise ValueError("pack_samples needs at least one sample")
    if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of} must be a positive integer or None")
    seqlens = [len(ids) for ids, _ in samples]
    for i, (ids, mask) in enumerate(samples):
        if len(ids) == 0 or len(mask) != len(ids):
            raise ValueError(
                f"sample {i} has {len(ids)} tokens and {len(mask)} loss-mask values; "
                "need at least one token and one mask value per token"
            )
    input_ids = torch.tensor([t for ids, _ in samples for t in ids], dtype=torch.long)  # [T]
    loss_mask = torch.tensor([m for _, mask in samples for m in mask], dtype=torch.bool)  # [T]
    doc_lengths = list(seqlens)
    num_padding = 0 if pad_to_multiple_of is None else -len(input_ids) % pad_to_multiple_of
    if num_padding:
        input_ids = torch.cat([input_ids, input_ids.new_full((num_padding,), pad_token_id)])
        loss_mask = torch.cat([loss_mask, loss_mask.new_zeros(num_padding)])
        doc_lengths.append(num_padding)
    lengths = torch.tensor(doc_lengths, dtype=torch.long)  # [D]
    cu_seqlens = torch.zeros(len(doc_lengths) + 1, dtype=torch.int32)  # [D + 1]
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    starts = cu_seqlens[:-1].long()  # [D]
    position_ids = torch.arange(len(input_ids)) - torch.repeat_interleave(starts, lengths)  # [T]
    labels = torch.full_like(input_ids, IGNORE_INDEX)  # [T]
    labels[:-1] = torch.where(loss_mask[1:], input_ids[1:], IGNORE_INDEX)
    # A document's last token has no target inside the document.
    labels[cu_seqlens[1:].long() - 1] = IGNORE_INDEX
    packed_fields = {
        name: _shifted_field(name, values, seqlens, labels, num_padding)
        for name, values in (fields or {}).items()
    }
    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        labels=labels,
        cu_seqlens=cu_seqlens,
        max_seqlen=max(doc_lengths),
        num_loss_tokens=int((labels != IGNORE_INDEX).sum()),  # host tensor: no device sync
        seqlens=seqlens,
        fields=packed_fields,
    )


def _shifted_field(
    name: str, values: Sequence[Sequence[float]], seqlens: list[int], labels: torch.Tensor, num_padding: int
) -> torch.Tensor:
    """Per-input-token values -> `[T]` fp32 in the labels' layout (see the module docstring)."""
    if len(values) != len(seqlens) or any(len(v) != n for v, n in zip(values, seqlens)):
        raise ValueError(
            f"field {name!r} needs one value per token of every sample ({seqlens} tokens); got "
            f"{[len(v) for v in values]}"
        )
    flat = torch.tensor([x for v in values for x in v], dtype=torch.float32)  # [T - padding]
    out = torch.zeros(len(flat) + num_padding, dtype=torch.float32)  # [T]
    out[:-1] = torch.cat([flat, flat.new_zeros(num_padding)])[1:]
    return out.masked_fill_(labels == IGNORE_INDEX, 0.0)


def unpack(batch: PackedBatch, values: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Split a `[T, ...]` tensor of the batch (default: `input_ids`) into its real documents."""
    values = batch.input_ids if values is None else values
    if values.shape[0] != batch.num_tokens:
        raise ValueError(f"values have {values.shape[0]} rows, the batch has {batch.num_tokens} tokens")
    return list(values[: sum(batch.seqlens)].split(batch.seqlens))
