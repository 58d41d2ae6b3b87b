"""`laden rl` under torchrun: each process generates its own share of a batch, and the processes of one
data-parallel index of the actor (its tensor, context and pipeline ranks) train on the union of their
shares. Gathering and summing over the ranks on the host group.

With rollout servers (`vllm:dN`, `sglang:dN`) rank 0 alone generates, the whole batch, over every
server: one client pauses, updates and resumes each server, so no rank's pause can abort another's
requests and every token's weight version stays exact, whatever the numbers of servers and of trainer
processes. The cost is one process's HTTP and reward work for the whole batch (the rewards run in a
pool of their own, `reward_workers`); the batch is then dealt to the data-parallel ranks in equal parts.
"""

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

    def _generation_share(self) -> tuple[int, int] | None:
        """(index, count) of this process's share of every batch's prompts (`prompts[index::count]`), or
        None: it generates none, rank 0 drives the rollout servers for every process."""
        if self.rt.world_size == 1:
            return 0, 1
        if not self.rollout_backend.in_process:
            return (0, 1) if self.rt.is_main else None
        return self.rt.rank, self.rt.world_size

    def _by_data_rank(self, groups: list[list[Any]]) -> list[list[list[Any]]]:
        """The groups each data-parallel rank trains on, in data-parallel order (the same list on every
        rank). Every process generates its own share of the batch (`_collect_batch`), so that every
        rollout engine works; the processes of one data-parallel index (its tensor, context and
        pipeline ranks, which take the same inputs) then train on the union of theirs, in rank order. Where rank
        0 generated the whole batch (rollout servers), data-parallel rank i trains on its groups i, i + D, ..."""
        if self.rt.world_size == 1:
            return [groups]
        everyone = self._gather((self._dp_rank(), groups))
        if not self.rollout_backend.in_process:  # rank 0 generated the whole batch: equal parts, in order
            batch = [g for _, part in everyone for g in part]
            return [batch[i :: self._dp_size()] for i in range(self._dp_size())]
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
