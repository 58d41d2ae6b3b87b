"""Padding micro-batches: what a rank runs when it has fewer micro-batches than the others.

FSDP's all-gathers and reduce-scatters (and a pipeline schedule's sends) must match across
ranks, so a rank with fewer micro-batches in a step runs padding ones: one ignored token,
which runs the forward and backward (the same collectives) and adds zero loss. An objective
that reads a per-token field of a padding micro-batch gets zeros (`ZeroFields`).
"""

from __future__ import annotations

import torch

from laden.data.batch import IGNORE_INDEX, PackedBatch


def padding_batch() -> PackedBatch:
    """One ignored token: runs forward/backward (matching collectives) and adds zero loss."""
    return PackedBatch(
        input_ids=torch.zeros(1, dtype=torch.long),
        position_ids=torch.zeros(1, dtype=torch.long),
        labels=torch.full((1,), IGNORE_INDEX, dtype=torch.long),
        cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
        max_seqlen=1,
        num_loss_tokens=0,
        seqlens=[1],
    )


class ZeroFields(dict):
    """The fields of a padding micro-batch: any name reads as zeros laid out like the labels."""

    def __init__(self, labels: torch.Tensor) -> None:
        super().__init__()
        self._labels = labels

    def __missing__(self, name: str) -> torch.Tensor:
        return torch.zeros(self._labels.shape, dtype=torch.float32, device=self._labels.device)
