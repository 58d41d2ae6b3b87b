"""Deterministic, resumable global batches: which sample indices each optimizer step uses.

The order of epoch e is `torch.randperm` under a generator seeded with `seed + e`, so it
is a function of (seed, epoch) alone: a resumed run rebuilds the permutation and skips to
its position instead of replaying the iterator, and sees exactly the batches of an
uninterrupted run. The state is three integers (epoch, step in epoch, seed) plus the
dataset shape it was taken for, checked on load. With `drop_last`, the remainder of each
epoch (fewer than `batch_size` samples) is skipped that epoch; shuffling moves it around.
`first` (`train_dataset.fail_fast`: `longest_first`) moves the given samples to the front of
epoch 0, the others keeping their order: the first step is the worst case for memory.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch


class GlobalBatchIterator:
    """The sample indices of each optimizer step: `next()` runs across epochs, `iter()` covers one epoch."""

    def __init__(
        self,
        num_samples: int,
        *,
        batch_size: int,
        shuffle: bool,
        seed: int,
        drop_last: bool = True,
        first: Sequence[int] = (),
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"train_dataset.batch_size={batch_size} must be at least 1")
        if num_samples < 1:
            raise ValueError("the dataset has no samples (check the length statistics)")
        if drop_last and num_samples < batch_size:
            raise ValueError(
                f"train_dataset.batch_size={batch_size} is larger than the {num_samples} samples kept, so an "
                f"epoch has no full batch; set train_dataset.batch_size to at most {num_samples} "
                "(or check the length statistics: samples may have been filtered)"
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.first = list(first)
        self.epoch = 0
        self.step_in_epoch = 0
        self._order: list[int] = []
        self._order_epoch = -1  # the epoch `_order` belongs to; rebuilt lazily

    @property
    def steps_per_epoch(self) -> int:
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def epoch_order(self, epoch: int) -> list[int]:
        """The sample order of `epoch`, a pure function of (seed, epoch, first)."""
        if not self.shuffle:
            order = list(range(self.num_samples))
        else:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        if epoch == 0 and self.first:
            front = set(self.first)
            order = self.first + [i for i in order if i not in front]
        return order

    def __next__(self) -> list[int]:
        """The next step's sample indices, crossing into the next epoch after the last batch."""
        if self._order_epoch != self.epoch:
            self._order, self._order_epoch = self.epoch_order(self.epoch), self.epoch
        step = self.step_in_epoch
        # Advanced before returning: a checkpoint taken after training on this batch resumes at the next.
        if step + 1 == self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        else:
            self.step_in_epoch = step + 1
        return self._order[step * self.batch_size : (step + 1) * self.batch_size]

    def __iter__(self) -> Iterator[list[int]]:
        """The remaining batches of the current epoch (`next()` instead runs on across epochs)."""
        epoch = self.epoch
        while self.epoch == epoch:
            yield next(self)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("num_samples", "batch_size"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"the checkpoint's data state was taken with {key}={state[key]}, this run has "
                    f"{key}={getattr(self, key)}; resuming would see different batches. Use the same "
                    "dataset, max_length/length_policy and batch_size as the checkpointed run"
                )
        if not 0 <= state["step_in_epoch"] < self.steps_per_epoch:
            raise ValueError(
                f"step_in_epoch={state['step_in_epoch']} is outside [0, {self.steps_per_epoch}) in the data state"
            )
        self.epoch, self.step_in_epoch, self.seed = state["epoch"], state["step_in_epoch"], state["seed"]
        self._order_epoch = -1


def longest_first(lengths: Sequence[int], batch_size: int) -> list[int]:
    """The indices of the `batch_size` longest samples, longest first (ties: the lower index)."""
    ranked = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return ranked[:batch_size]
