"""The archon engine's state across its stages: Hugging Face weights gathered whole, the checkpoint layout.

Each function takes the `ArchonEngine` whose stages, mesh and optimizer it reads (the engine's
methods `named_weights`, `state_dict`, `load_state_dict` and `checkpoint_items` call them after
their own checks).

Weights: the Hugging Face names are walked in order; the owning pipeline rank gathers each
tensor within its stage (FSDP's `full_tensor`; an expert shard as a DTensor over `ep`, then its
all-gather) and broadcasts it to every rank, so every rank iterates to the end.

Checkpoints: `engine_state` is this rank's part of the shared layout (`laden.engine.base`),
live tensors with expert shards as DTensors over `ep`; `load_engine_state` takes that layout or
full plain tensors (each rank cuts its own slice, `laden.engine.parallel.params.own_slice`, and
its expert shard). `checkpoint_items` sends each tensor of every stage to rank 0, which writes
it, so a checkpoint saved at one layout loads at any other (`laden.engine.checkpoint`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from laden.engine.parallel.params import local_shard, own_slice
from laden.model.moe import expert_shard

if TYPE_CHECKING:
    from laden.engine.archon.engine import ArchonEngine

ItemMeta = dict[tuple[str, str], tuple[tuple[int, ...], torch.dtype]]
"""(file stem, key) -> the shape and dtype of a checkpoint tensor (what rank 0 receives)."""


def iter_weights(
    engine: ArchonEngine, dtype: torch.dtype, device: torch.device | str | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """`named_weights`: each Hugging Face tensor whole on every rank, in `dtype` on `device`."""
    local = dict(engine.named_params())
    for name in engine.hf_names:
        with torch.no_grad():
            param = local.get(name) if engine.owner[name] == engine.pp_rank else None
            full = _gather(engine, param, name, dtype)
        yield name, full.to(device or full.device)
        del full


def _gather(engine: ArchonEngine, param: torch.Tensor | None, name: str, dtype: torch.dtype) -> torch.Tensor:
    """`name` whole on every rank: gathered on its pipeline rank, broadcast from there."""
    if param is not None:
        full = _full_local(engine, param).to(dtype)
    else:
        full = torch.empty(engine.full_shapes[name], dtype=dtype, device=engine.device)
    if engine.distributed and engine.pp > 1:
        dist.broadcast(full, src=engine.ranks[engine.owner[name]][0])
    return full


def _full_local(engine: ArchonEngine, t: torch.Tensor) -> torch.Tensor:
    """A parameter (or a state laid out like one) whole, within its stage (a collective of the stage)."""
    t = as_dtensor(engine, t)
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def as_dtensor(engine: ArchonEngine, t: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """An expert shard (or its optimizer state) as a DTensor over the `ep` axis; anything else as is."""
    from torch.distributed.tensor import Shard

    shard = expert_shard(like if like is not None else t)
    if shard is None or not engine.distributed or engine.ep == 1 or isinstance(t, DTensor):
        return t
    return DTensor.from_local(t, engine.mesh["ep"], [Shard(shard.dim)], run_check=False)


def engine_state(engine: ArchonEngine) -> dict[str, Any]:
    """This rank's part of the shared layout: its stages' parameters (DTensors; expert shards as
    DTensors over `ep`) and their optimizer states, live."""
    from laden.optim import named_state

    named = dict(engine.named_params())
    params = {n: as_dtensor(engine, p) for n, p in named.items()}
    names = {id(p): n for n, p in named.items()}
    optim = named_state(engine.optimizer, names, wrap=lambda value, p: as_dtensor(engine, value, like=p))
    return {"model": params, "optimizer": optim, "scheduler": engine.scheduler.state_dict(),
            "version": engine.version}  # fmt: skip


@torch.no_grad()
def load_engine_state(engine: ArchonEngine, state: dict[str, Any]) -> int:
    """Load the shared layout (this rank's part, or full plain tensors), in place where it already is;
    returns the checkpoint's `version`."""
    from laden.optim import load_named_state

    named = dict(engine.named_params())
    missing = sorted(set(named) - set(state["model"]))
    if missing:
        raise KeyError(
            f"the checkpoint holds no weights for {missing[:5]}; resume with the model it was written for"
        )
    for name, p in named.items():
        target = as_dtensor(engine, p)
        src = own_slice(state["model"][name], target)
        src, dst = local_shard(src), local_shard(target)
        if src.data_ptr() != dst.data_ptr():
            dst.copy_(_expert_slice(src, p))
    names = {id(p): n for n, p in named.items()}
    saved = state["optimizer"]
    local_states = {n: {k: _expert_slice(local_shard(own_slice(v, as_dtensor(engine, named[n]))), named[n])
                        for k, v in entry.items()} for n, entry in saved["state"].items() if n in named}  # fmt: skip
    # The param groups differ between stages and layouts (a stage without norms has no no-decay group):
    # their hyper-parameters come from this run's settings, the schedule's position from the checkpoint.
    load_named_state(engine.optimizer, names, {**saved, "state": local_states, "param_groups": []})
    _load_schedule_position(engine.optimizer, engine.scheduler, state["scheduler"])
    return int(state["version"])


def _load_schedule_position(optimizer: torch.optim.Optimizer, scheduler: Any, saved: dict[str, Any]) -> None:
    """This run's LR schedule at the checkpoint's step (every group follows the same schedule)."""
    fresh = {**scheduler.state_dict(), "last_epoch": saved["last_epoch"], "_step_count": saved["_step_count"]}
    scheduler.load_state_dict(fresh)
    lrs = [base * f(scheduler.last_epoch) for f, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


def _expert_slice(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A full expert tensor (from a layout without expert parallel) cut to this rank's shard."""
    shard = expert_shard(param)
    local = local_shard(param)
    if shard is None or value.dim() == 0 or value.shape[shard.dim] == local.shape[shard.dim]:
        return value
    return value.narrow(shard.dim, shard.offset, local.shape[shard.dim])


def checkpoint_items(
    engine: ArchonEngine, state: dict[str, Any]
) -> Iterator[tuple[str, str, torch.Tensor | None]]:
    """(file stem, key, whole host tensor on rank 0 / None elsewhere) of `state` (the engine's
    `state_dict()`) and of every other stage's, in one order; every rank iterates to the end."""
    from laden.engine.checkpoint import flat_tensors
    from laden.model.hf.export import host_copy

    local = {(stem, key): t for stem, key, t in flat_tensors(state)}
    order, meta = _global_items(engine, local)
    rank = dist.get_rank() if engine.distributed else 0
    for stem, key, owner in order:
        full = host_copy(local[(stem, key)]) if owner == engine.pp_rank else None  # a stage collective
        if engine.distributed:
            src = engine.ranks[owner][0]
            if src != 0 and rank == src:
                assert full is not None
                dist.send(full, dst=0, group=engine.host_group)
            elif src != 0 and rank == 0:
                shape, dtype = meta[(stem, key)]
                full = torch.empty(shape, dtype=dtype)
                dist.recv(full, src=src, group=engine.host_group)
        yield stem, key, full if rank == 0 else None


def _global_items(
    engine: ArchonEngine, local: dict[tuple[str, str], torch.Tensor]
) -> tuple[list[tuple[str, str, int]], ItemMeta]:
    """Every (stem, key) of every pipeline rank with its owner (the lowest pipeline rank holding it),
    and each one's shape and dtype."""
    mine = [
        (stem, key, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for (stem, key), t in local.items()
    ]
    meta: ItemMeta = {}
    if not engine.distributed:
        return [(stem, key, 0) for stem, key, _, _ in mine], meta
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine, group=engine.host_group)
    order, seen = [], set()
    for r in range(engine.pp):
        for stem, key, shape, dtype in every[engine.ranks[r][0]]:
            if (stem, key) not in seen:
                seen.add((stem, key))
                order.append((stem, key, r))
                meta[(stem, key)] = (shape, getattr(torch, dtype))
    return sorted(order, key=lambda item: item[0] != "model"), meta  # weights first, as written elsewhere
