"""The root module of the `fsdp` engine: final hidden states and the head weight, handed to an objective.

FSDP2 gathers a unit's parameters in the unit's forward pre-hook, so the embedding, the
final norm and the LM head (the root unit) are only materialised while a *root* forward
runs. The objective reads the LM head weight directly (chunked, no logits module call), so
the objective runs inside the root's forward: `ObjectiveRoot.forward(batch, objective)`
returns `objective(hidden [T, H], head_weight [V, H], batch)` for this rank's part of one
micro-batch (a summed loss, or the per-token outputs of `TrainEngine.forward`).

Per rank, depending on the mesh:
- context parallel: `batch` is the rank's contiguous slice of the padded row (tokens, labels,
  fields) with the full row's `cu_seqlens` (Ulysses attention gathers the sequence per head
  group), so the objective sees `[T/c, H]` hidden states and `[T/c]` labels and fields;
- tensor parallel: hidden states are replicated and the LM head is split on the vocabulary;
  `CrossEntropy` runs vocab-parallel, any other objective on the gathered head
  (`laden.engine.parallel.objective.apply_objective`, which says what each costs);
- otherwise: the objective as given, on the plain (gathered) head weight.

Labels are already shifted per document (`PackedBatch`), which is what lets a row be cut
anywhere for context parallelism.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from laden.data.batch import PackedBatch
from laden.engine.parallel.objective import apply_objective
from laden.model.attention import lm_head_weight, packed_forward_hidden


class ObjectiveRoot(nn.Module):
    """Root module: `forward(batch, objective)` -> `objective(hidden, head_weight, batch)`."""

    def __init__(
        self,
        model: nn.Module,
        *,
        tp_group: dist.ProcessGroup | None = None,
        head_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.tp_group = tp_group
        self.head_dtype = head_dtype

    def forward(self, batch: PackedBatch, objective: Any) -> Any:
        hidden = packed_forward_hidden(
            self.model, batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen
        )  # [T, H]
        weight = lm_head_weight(self.model)
        if self.head_dtype is not None:
            # Under autocast the residual stream and the master head weight are fp32, and an objective's
            # own GEMMs (the chunked loss's weight-gradient accumulation is an in-place addmm, which
            # autocast leaves alone) would run in fp32: 0.83 s of a 2.5 s step on an H200, as SIMT
            # sgemm. The objective sees what the roundpipe engine's head sees: compute-dtype tensors.
            hidden, weight = hidden.to(self.head_dtype), weight.to(self.head_dtype)
        return apply_objective(objective, hidden, weight, batch, tp_group=self.tp_group)
