"""`laden rl` under torchrun: each process generates its own share of a batch, and the processes of one
data-parallel index of the actor (its tensor, context and pipeline ranks) train on the union of their
shares. Gathering and summing over the ranks on the host group."""

from __future__ import annotations

import logging
from typing import Any

import torch

from laden.rl.run_part import RunPart

log = logging.getLogger("laden.rl")


class DataRanks(RunPart):
    """Gathering over the ranks of a `laden rl` run (a part of `laden.rl.trainer._Run`)."""

    def _gather(self, obj: Any) -> list[Any]:
        """`obj` of every rank, in rank order (the host group; `[obj]` in one process)."""
        if self.rt.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.rt.world_size
        torch.distributed.all_gather_object(out, obj, group=self.rt.host_group)
        return out

    def _dp_rank(self) -> int:
        return self.engine.dp_rank if self.rt.world_size > 1 else 0

    def _dp_size(self) -> int:
        return self.engine.dp_size if self.rt.world_size > 1 else 1

    def _by_data_rank(self, groups: list[list[Any]]) -> list[list[list[Any]]]:
        """The groups each data-parallel rank trains on, in data-parallel order (the same list on every
        rank). Every process generates its own share of the batch (`_collect_batch`), so that every
        rollout engine works; the processes of one data-parallel index (its tensor, context and
        pipeline ranks, which take the same inputs) then train on the union of theirs, in rank order."""
        if self.rt.world_size == 1:
            return [groups]
        everyone = self._gather((self._dp_rank(), groups))
        return [[g for d, part in everyone if d == i for g in part] for i in range(self._dp_size())]

    def _of_each_data_rank(self, obj: Any) -> list[Any]:
        """`obj` of every data-parallel rank, in order (from its first process; the others hold the same)."""
        everyone = self._gather((self._dp_rank(), obj))
        return [next(o for d, o in everyone if d == i) for i in range(self._dp_size())]

    def _sum(self, value: int) -> int:
        """A count of this rank's training data summed over the data-parallel ranks (the processes of one
        data-parallel index hold the same data and count it once)."""
        if self.rt.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        torch.distributed.all_reduce(t, group=self.rt.host_group)
        replicas = self.rt.world_size // self._dp_size()
        return int(t.item()) // replicas
