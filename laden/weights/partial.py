"""`PartialUpdate`: a weight update that carries only some of a model's weights, on purpose.

A weight update normally carries every weight, and receivers check that (a name the source
never gave is an error: the source is likely another model). A LoRA run changes only its
adapted projections (`TrainEngine.named_weights(trained_only=True)`, `laden.model.lora`); the
embedding, the head and the norms stay the base model's, which every rollout engine loaded
from `actor.path`. Sending only the changed tensors saves most of the update's bytes, and the
source says so by being a `PartialUpdate`: `fill_in_place` then leaves the weights it is not
given as they are, and `write_weights` records it in the version's manifest so that
`read_weights` hands the version out as one again. Every name given must still exist with its
shape at the receiver.

Trade-off: the receiver must already hold the other weights. A rollout engine that released
its weights (`sleep(weights=True)`) or a server that reloads a whole directory (vLLM's
`reload_weights` refuses missing tensors) needs a full update; the trainer sends one then.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

__all__ = ["PartialUpdate"]


class PartialUpdate(Iterator[tuple[str, torch.Tensor]]):
    """`(name, tensor)` pairs of some of a model's weights, consumed once; a receiver keeps the others."""

    def __init__(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._pairs = iter(pairs)  # e.g. an engine's `named_weights(trained_only=True)`

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._pairs)
