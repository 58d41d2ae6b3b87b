"""The per-rank packed loss of the `fsdp` engine, as the root module FSDP wraps.

FSDP2 gathers a unit's parameters in the unit's forward pre-hook, so the embedding, the
final norm and the LM head (the root unit) are only materialised while a *root* forward
runs. The packed loss reads the LM head weight directly (chunked cross-entropy, no logits
module call), so the loss itself is the root: `PackedLossModule.forward` returns the summed
token loss of this rank's part of one micro-batch.

Per rank, depending on the mesh:
- context parallel: the rank's contiguous slice of the padded row, the full row's
  `cu_seqlens` (Ulysses attention gathers the sequence per head group);
- tensor parallel: hidden states are replicated, the LM head is split on the vocabulary and
  the loss is the vocab-parallel chunked cross-entropy;
- otherwise: the chunked linear + cross-entropy of `laden.model.loss`.

Labels are already shifted per document (`PackedBatch`), which is what lets a row be cut
anywhere for context parallelism.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from laden.engine.fsdp.vocab_parallel import vocab_parallel_cross_entropy, vocab_shard_range
from laden.model.attention import lm_head_weight, packed_forward_hidden
from laden.model.loss import chunked_linear_cross_entropy, linear_cross_entropy


class PackedLossModule(nn.Module):
    """Root module: `forward(ids, pos, labels, cu_seqlens, max_seqlen)` -> summed token loss (fp32)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        chunked: bool,
        chunk_size: int,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.chunked = chunked
        self.chunk_size = chunk_size
        self.tp_group = tp_group

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        labels: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
    ) -> torch.Tensor:
        hidden = packed_forward_hidden(self.model, input_ids, position_ids, cu_seqlens, max_seqlen)  # [T, H]
        weight = lm_head_weight(self.model)
        if isinstance(weight, DTensor) and self.tp_group is not None:
            tp_rank, tp_size = dist.get_rank(self.tp_group), dist.get_world_size(self.tp_group)
            start, _ = vocab_shard_range(weight.shape[0], tp_rank, tp_size)
            return vocab_parallel_cross_entropy(
                hidden,
                weight.to_local(),  # [V / tp, H]
                labels,
                vocab_start=start,
                group=self.tp_group,
                chunk_size=self.chunk_size,
            )
        if self.chunked:
            return chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=self.chunk_size)
        return linear_cross_entropy(hidden, weight, labels)
