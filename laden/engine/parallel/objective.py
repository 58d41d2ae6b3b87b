"""An objective on the head of a parallel engine: split on the vocabulary or whole.

`apply_objective(objective, hidden, head_weight, batch)` is what an engine's last stage calls
(the fsdp engine's `ObjectiveRoot`, the archon engine's last pipeline stage). Under tensor
parallel the hidden states are replicated and the LM head is split on the vocabulary:
`CrossEntropy` runs as the vocab-parallel chunked cross-entropy (three small all-reduces per
chunk, no gathered weight, `vocab_parallel`). Any other objective gets the full head weight
(`DTensor.full_tensor()`, differentiable: its backward hands each rank its rows' gradient).
That costs one all-gather of the `[V, H]` head per micro-batch and a full `[V, H]` copy on
every rank while the objective runs: fine for RL objectives next to the rollout's cost, and
the reason SFT keeps the vocab-parallel path. Otherwise the objective runs as given, on the
plain (gathered) head weight.

`TokenOutputs` is `TrainEngine.forward`'s per-token outputs (log-probs, entropies) shaped as
an objective, so the same stage code computes a loss or the outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from laden.data.batch import PackedBatch
from laden.engine.parallel.vocab_parallel import vocab_parallel_cross_entropy, vocab_shard_range
from laden.model.objective import CrossEntropy, token_outputs


def apply_objective(
    objective: Any, hidden: torch.Tensor, weight: torch.Tensor, batch: PackedBatch, *, tp_group: Any = None
) -> Any:
    """`objective(hidden, head_weight, batch)`, with a vocabulary-split head weight (tensor parallel) as the
    module docstring says: the vocab-parallel cross-entropy, else the gathered head."""
    if not isinstance(weight, DTensor):
        return objective(hidden, weight, batch)
    if isinstance(objective, CrossEntropy) and tp_group is not None:
        return _vocab_parallel_cross_entropy(hidden, weight, batch, objective, tp_group)
    return objective(hidden, weight.full_tensor(), batch)  # [V, H] on every rank: see the docstring


def _vocab_parallel_cross_entropy(
    hidden: torch.Tensor, weight: DTensor, batch: PackedBatch, objective: CrossEntropy, tp_group: Any
) -> torch.Tensor:
    tp_rank, tp_size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    start, _ = vocab_shard_range(weight.shape[0], tp_rank, tp_size)
    # `chunked=False` asks for the full logits: one chunk of every token gives exactly that.
    chunk_size = objective.chunk_size if objective.chunked else max(hidden.shape[0], 1)
    return vocab_parallel_cross_entropy(
        hidden,
        weight.to_local(),  # [V / tp, H]
        batch.labels,
        vocab_start=start,
        group=tp_group,
        chunk_size=chunk_size,
    )


@dataclass(frozen=True, slots=True)
class TokenOutputs:
    """`forward`'s per-token outputs as an objective-shaped callable (run where the objective would)."""

    outputs: tuple[str, ...]
    """Which outputs, of `laden.engine.base.KNOWN_FORWARD_OUTPUTS`."""
    temperature: float
    """The logits are divided by it before the softmax."""
    chunk_size: int
    """Tokens per chunk of the head (never `[T, V]` logits)."""

    def __call__(self, hidden: torch.Tensor, head_weight: torch.Tensor, batch: PackedBatch) -> dict:
        return token_outputs(
            hidden,
            head_weight,
            batch.labels,
            self.outputs,
            temperature=self.temperature,
            chunk_size=self.chunk_size,
        )
