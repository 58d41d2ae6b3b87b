"""Tracking one engine step's gradients as they land: completion, all-reduce, norm, early updates.

A parameter group's gradient is complete when every backward residency that touches it
has landed (two for a tied embedding used by the first and the last stage). Complete
groups are *finalized* in a fixed order, the order a one-device run completes them (by the
last backward stage that touches them, and within it from the last layer to the first, as the
backward and the early gradient downloads reach them): data-parallel all-reduce, the group's norm
(computed on the device before the copy when the inbox holds exactly that one copy, else by a host
pass), and, when no clipping needs the global norm first, the group's update. The fixed order makes
every replica issue the same collectives in the same order and the norm's summation
order deterministic; a group that lands early just waits for its turn.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from laden.engine.roundpipe.host.store import ParamGroup
from laden.engine.roundpipe.plan import ModelExecutePlan
from laden.engine.roundpipe.residency import GradLanding


class StepGrads:
    """Per-step landing bookkeeping of the engine (see the module docstring)."""

    def __init__(
        self,
        pipe: Any,
        plan: ModelExecutePlan,
        inbox: int,
        *,
        process_group: Any,
        update: Callable[[ParamGroup], None] | None,
        carried: frozenset[int] = frozenset(),
    ) -> None:
        self.store = pipe.store
        self.inbox = inbox
        self.process_group = process_group
        self.update = update
        self.remaining, last_stage = _expected_landings(self.store, plan, carried)
        # Groups whose inbox is exactly one landing's copy (one landing, not added to earlier
        # data): the norm computed on the device before the copy is the inbox's norm.
        self.copied_norms: dict[int, torch.Tensor] = {}
        self.single = {gid for gid, n in self.remaining.items() if n == 1}
        groups = [g for g in self.store.groups if g.index in self.remaining]
        self.order = sorted(groups, key=lambda g: (last_stage[g.index], -g.layer, g.index))
        self.ready: set[int] = set()
        self.cursor = 0
        self.norms: list[torch.Tensor] = []
        self.updated: set[int] = set()
        self.lock = threading.Lock()

    def on_landing(self, landing: GradLanding) -> None:
        """Landing thread: count the landing; finalize every group whose turn has come."""
        group = landing.group if landing.group is not None else landing.param.group  # type: ignore[union-attr]
        with self.lock:
            if landing.group is not None and landing.norm is not None and group.index in self.single:
                self.copied_norms[group.index] = landing.norm
            self.remaining[group.index] -= 1
            if self.remaining[group.index] == 0:
                self.ready.add(group.index)
            while self.cursor < len(self.order) and self.order[self.cursor].index in self.ready:
                self._finalize(self.order[self.cursor])
                self.cursor += 1

    def _finalize(self, group: ParamGroup) -> None:
        flat = group.grad_flats[self.inbox]
        if self.process_group is not None:
            dist.all_reduce(flat, group=self.process_group)  # losses are normalised globally: a sum
            norm = torch.linalg.vector_norm(flat, dtype=torch.float32)
        else:  # a host pass over the gradient only where the device could not tell
            norm = self.copied_norms.pop(group.index, None)
            if norm is None:
                norm = torch.linalg.vector_norm(flat, dtype=torch.float32)
        self.norms.append(norm)
        if self.update is not None:
            self.update(group)
            self.updated.add(group.index)

    def check_complete(self) -> None:
        if self.cursor != len(self.order):
            missing = [g.index for g in self.order[self.cursor :]]
            raise RuntimeError(
                f"gradients of parameter groups {missing} never landed; the plan skipped layers"
            )

    def norm(self) -> torch.Tensor:
        """Global L2 norm of the step's gradients (host fp32 tensor)."""
        if not self.norms:
            return torch.zeros(())
        return torch.linalg.vector_norm(torch.stack(self.norms))

    def pending_updates(self) -> list[ParamGroup]:
        """Groups not updated yet, in forward (layer) order."""
        return [g for g in sorted(self.order, key=lambda g: g.index) if g.index not in self.updated]


def _expected_landings(
    store: Any, plan: ModelExecutePlan, carried: frozenset[int] = frozenset()
) -> tuple[dict[int, int], dict[int, int]]:
    """Landings per trainable group in one call, and the last backward stage that touches it.

    Mirrors `residency.upload_stage`: one landing per owned group per stage, plus one per
    parameter used in a stage that does not own its group, unless its gradient is `carried`
    on the device to the owner's stage (`residency.carried_params`).
    """
    remaining: dict[int, int] = {}
    last: dict[int, int] = {}
    for stage_index, stage in enumerate(plan.bwd_plan):
        owned = {g.index for layer in stage for g in store.layers[layer].groups if g.trainable}
        foreign = {
            hp.index: hp.group.index
            for layer in stage
            for hp in store.layers[layer].foreign
            if hp.trainable and hp.group.index not in owned and hp.index not in carried
        }
        for gid in [*owned, *foreign.values()]:
            remaining[gid] = remaining.get(gid, 0) + 1
            last[gid] = stage_index
    return remaining, last
