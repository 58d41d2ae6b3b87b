"""What the engine's head step hands an objective: the final hidden states, the head weight, the batch.

The pipeline calls a loss function `loss_fn(head_output, label)` once per micro-batch on the
device that runs the fused stage, where `label` is whatever the call's label handoff held,
moved to that device. The engine's label is the whole micro-batch (`batch_tree`): every
`PackedBatch` tensor (labels, per-token `fields`, ids, positions, document offsets) as the
leaves of a small pytree, so each crosses the bus like any other handoff, and its scalars as
one opaque leaf that stays on the host. `device_batch` rebuilds the `PackedBatch` on the
device, which is what `laden.engine.base.Objective` promises an objective.

The cost: a few `[T]` integer and fp32 vectors per micro-batch beside the `[T, H]` hidden
states (the ids travel twice, once as the first layer's input): nothing next to a stage's
weights, and an objective may read any field without the engine knowing its name.

`ObjectiveLoss` is the training and evaluation head (the objective's sum over the step's
normalizer); `TokenOutputsLoss` is `TrainEngine.forward`'s head: it returns the per-token
outputs (`laden.model.objective.token_outputs`) as the micro-batch's "losses", which the
pipeline parks per micro-batch without summing them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from laden.data.batch import PackedBatch
from laden.engine.base import KNOWN_FORWARD_OUTPUTS, Objective
from laden.model.objective import token_outputs
from laden.model.split import LMHeadOutput

_TENSORS = ("input_ids", "position_ids", "labels", "cu_seqlens")


class _HostPart:
    """The micro-batch itself as one pytree leaf: its scalars and lists stay on the host."""

    __slots__ = ("batch",)

    def __init__(self, batch: PackedBatch) -> None:
        self.batch = batch


def batch_tree(mb: PackedBatch) -> dict[str, Any]:
    """The micro-batch as a label handoff: its tensors as pytree leaves (they travel), the rest not."""
    tensors = {name: getattr(mb, name) for name in _TENSORS}
    return {"tensors": tensors, "fields": dict(mb.fields), "host": _HostPart(mb)}


def device_batch(tree: dict[str, Any]) -> PackedBatch:
    """The `PackedBatch` of a fetched `batch_tree`, its tensors on the device they were fetched to."""
    host: PackedBatch = tree["host"].batch
    return dataclasses.replace(host, **tree["tensors"], fields=dict(tree["fields"]))


def packed_kwargs(mb: PackedBatch) -> dict[str, Any]:
    """One packed row as the split model's inputs (labels are already shifted per document)."""
    return {
        "input_ids": mb.input_ids[None],  # [1, T]
        "position_ids": mb.position_ids[None],  # [1, T]
        "cu_seq_lens_q": mb.cu_seqlens,
        "cu_seq_lens_k": mb.cu_seqlens,
        "max_length_q": mb.max_seqlen,
        "max_length_k": mb.max_seqlen,
    }


def _hidden(outputs: LMHeadOutput) -> torch.Tensor:
    hidden = outputs.hidden_states
    return hidden.reshape(-1, hidden.shape[-1])  # [T, H]


class ObjectiveLoss:
    """A micro-batch's `objective(hidden, head_weight, batch) / normalizer` (training and evaluation)."""

    def __init__(self, objective: Objective, normalizer: float) -> None:
        self.objective = objective
        self.normalizer = float(normalizer)

    def __call__(self, outputs: LMHeadOutput, tree: dict[str, Any]) -> torch.Tensor:
        loss = self.objective(_hidden(outputs), outputs.lm_head_weight, device_batch(tree))
        return loss / self.normalizer


class TokenOutputsLoss:
    """`TrainEngine.forward`'s head: the requested per-token outputs (`[T]` fp32 each), in order."""

    def __init__(self, outputs: Sequence[str], *, temperature: float, chunk_size: int) -> None:
        self.outputs = check_outputs(outputs)
        if not temperature > 0:
            raise ValueError(f"temperature={temperature} must be positive (gconfig.temperature); use 1.0")
        self.temperature = float(temperature)
        self.chunk_size = chunk_size

    def __call__(self, outputs: LMHeadOutput, tree: dict[str, Any]) -> list[torch.Tensor]:
        batch = device_batch(tree)
        values = token_outputs(
            _hidden(outputs), outputs.lm_head_weight, batch.labels, self.outputs,
            temperature=self.temperature, chunk_size=self.chunk_size,
        )  # fmt: skip
        return [values[name] for name in self.outputs]


def check_outputs(outputs: Sequence[str]) -> list[str]:
    """The requested forward outputs as a list; a ValueError names any unknown one."""
    names = list(outputs)
    unknown = sorted(set(names) - set(KNOWN_FORWARD_OUTPUTS))
    if unknown:
        raise ValueError(f"outputs {unknown} are not known; ask for any of {list(KNOWN_FORWARD_OUTPUTS)}")
    return names
