"""Objectives on the final hidden states (`laden.engine.base.Objective`) and the gradient-free outputs.

`CrossEntropy` is the SFT objective: the summed next-token cross-entropy of a packed row,
through the chunked linear + cross-entropy of `laden.model.loss` (`chunked=True`, so at most
`[chunk_size, V]` logits exist at once) or through full fp32 logits (`chunked=False`, the
reference path of `actor.chunked_loss: false`). Every engine runs it the same way, which is
what makes `actor.chunked_loss` and `actor.loss_chunk_size` mean the same under each of them.

`token_outputs` computes what `TrainEngine.forward` returns (log-probs of the labels and
entropies, `[T]` fp32; a value model's values) from the same inputs, chunked the same way.

RL's objectives (`laden.rl`) have the same signature; they read per-token `batch.fields`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from laden.data.batch import PackedBatch
from laden.model.loss import (
    DEFAULT_LOSS_CHUNK_SIZE,
    chunked_linear_cross_entropy,
    chunked_token_logprobs_and_entropy,
    linear_cross_entropy,
)
from laden.model.value_head import token_values


@dataclass(frozen=True, slots=True)
class CrossEntropy:
    """Summed next-token cross-entropy of a micro-batch (`actor.chunked_loss`, `actor.loss_chunk_size`)."""

    chunked: bool = True
    """Walk the tokens in chunks (no `[T, V]` logits); False builds the full fp32 logits."""
    chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE
    """Tokens per chunk (a `[chunk, V]` fp32 buffer each)."""

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError(f"actor.loss_chunk_size={self.chunk_size} must be >= 1 token, e.g. 1024")

    def __call__(self, hidden: torch.Tensor, head_weight: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        return self.on_labels(hidden, head_weight, batch.labels)

    def on_labels(
        self, hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
    ) -> torch.Tensor:
        """The summed loss of `hidden [..., H]` against next-token `labels [...]` (already shifted)."""
        labels = labels.reshape(-1)  # [T]
        hidden = hidden.reshape(-1, hidden.shape[-1])  # [T, H]
        if self.chunked:
            return chunked_linear_cross_entropy(
                hidden, head_weight, labels, chunk_size=self.chunk_size, ignore_index=ignore_index
            )
        return linear_cross_entropy(hidden, head_weight, labels, ignore_index=ignore_index)


def token_outputs(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    outputs: Sequence[str],
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE,
) -> dict[str, torch.Tensor]:
    """The requested per-token outputs, each `[T]` fp32, without `[T, V]` logits.

    `logprobs` and `entropy` of a language model's head; `values`, a value model's (its one-row
    head, `laden.model.value_head`), at every token whatever its label.
    """
    unknown = sorted(set(outputs) - {"logprobs", "entropy", "values"})
    if unknown:
        raise ValueError(f"outputs {unknown} are not known; ask for 'logprobs', 'entropy' or 'values'")
    hidden = hidden.reshape(-1, hidden.shape[-1])  # [T, H]
    out: dict[str, torch.Tensor] = {}
    if "values" in outputs:
        out["values"] = token_values(hidden, head_weight)
    if "logprobs" in outputs or "entropy" in outputs:
        out["logprobs"], out["entropy"] = chunked_token_logprobs_and_entropy(
            hidden, head_weight, labels.reshape(-1), chunk_size=chunk_size, temperature=temperature
        )
    return {name: out[name] for name in outputs}
