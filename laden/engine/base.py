"""The train-engine seam.

Every training backend (`actor.backend`: single device, FSDP2, roundpipe) implements
`TrainEngine`. The trainer hands an engine the packed micro-batches of ONE optimizer step
together with the step's global number of loss tokens; the engine returns scalar metrics.
Normalising each micro-batch's summed token loss by the *global* count is what makes the
loss the token mean over the whole batch however it is split across micro-batches, ranks
or calls (micro-batched == one batch).

Data-parallel engines also expose `dp_rank` and `dp_size`: the trainer gives each rank its
share of the global batch (engines without them are one replica), while the normaliser
stays the loss-token count of the whole global batch.

Metrics come back as tensors, not floats, so an engine never forces a host sync; the
trainer syncs once per logged step.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from laden.data.batch import PackedBatch


@runtime_checkable
class TrainEngine(Protocol):
    """One optimizer step at a time over packed micro-batches."""

    def train_batch(
        self, micro_batches: Sequence[PackedBatch], *, global_num_loss_tokens: int
    ) -> dict[str, torch.Tensor]:
        """Forward/backward every micro-batch, clip, step the optimizer and the LR schedule.

        Returns at least `loss` (token-mean over the global batch), `grad_norm` and `lr`.
        """
        ...

    def eval_batch(
        self, micro_batches: Sequence[PackedBatch], *, global_num_loss_tokens: int
    ) -> dict[str, torch.Tensor]:
        """Token-mean loss without gradients."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and LR-scheduler state for resumable checkpoints."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def export_hf(self, out_dir: Path, *, tokenizer: Any | None = None) -> None:
        """Write a Hugging Face model directory (safetensors in the compute dtype)."""
        ...

    @property
    def num_params(self) -> int: ...
