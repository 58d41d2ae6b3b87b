"""Checkpoint state of the `fsdp` engine in the shared layout, and distributed-checkpoint helpers.

`engine_state` is what `FSDPEngine.state_dict()` returns: `{"model": {name: trained parameter},
"optimizer": laden.optim.named_state(...), "scheduler": ..., "version": int}`, keyed by the
Hugging Face parameter names, holding the live tensors (sharded DTensors under FSDP, with the
host-resident states of `ShardedAdamW` wrapped as DTensors laid out like their parameters).
A distributed checkpoint (DCP) of it therefore reshards: saved at `d4`, it loads at `d2` or in
one plain process, each rank reading the pieces its own shards need, and loading into the
template returned by `state_dict()` writes in place. Master weights and optimizer states keep
the storage dtype (fp32), so resumed training is exact.

`load_engine_state` accepts the layout with DTensors or with plain full tensors (a checkpoint
written by a single-process engine and read with `torch.load`): for a sharded parameter each
rank copies its own slice of a full tensor, without a collective (`laden.engine.parallel.params.own_slice`).

`save_dcp` / `load_dcp` write and read any nested dict of tensors, DTensors and plain values
with `torch.distributed.checkpoint`, under a process group or in one plain process (quietly).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from laden.engine.parallel.params import local_shard, own_slice
from laden.optim import load_named_state, named_state


def engine_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    version: int,
) -> dict[str, Any]:
    """The shared checkpoint layout over the live tensors (see the module docstring)."""
    params = trained_parameters(model)
    fqn_state_dict = getattr(optimizer, "fqn_state_dict", None)
    if fqn_state_dict is not None:  # ShardedAdamW: host states wrapped like their parameters
        optim_state = fqn_state_dict(model)
    else:
        optim_state = named_state(optimizer, {id(p): n for n, p in params.items()})
    return {
        "model": params,
        "optimizer": optim_state,
        "scheduler": scheduler.state_dict(),
        "version": version,
    }


@torch.no_grad()
def load_engine_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: Mapping[str, Any],
) -> int:
    """Copy a checkpoint in the shared layout into the engine's tensors; return its `version`."""
    params = trained_parameters(model)
    _check_names(set(params), set(state["model"]))
    for name, p in params.items():
        src, dst = local_shard(own_slice(state["model"][name], p)), local_shard(p)
        if src.data_ptr() != dst.data_ptr():  # not loaded in place: write it back
            dst.copy_(src)
    saved_optim = state["optimizer"]
    local_states = {
        name: {key: own_slice(value, params[name]) for key, value in entry.items()}
        for name, entry in saved_optim["state"].items()
        if name in params
    }
    names = {id(p): n for n, p in params.items()}
    load_named_state(optimizer, names, {**saved_optim, "state": local_states})
    scheduler.load_state_dict(state["scheduler"])
    return int(state["version"])


def trained_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """`{name: parameter}` of what training changes (tied weights once, under the first name): every
    parameter, or a LoRA model's adapters (its frozen base is the one loaded from `actor.path`)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _check_names(expected: set[str], saved: set[str]) -> None:
    missing, unexpected = sorted(expected - saved), sorted(saved - expected)
    if missing or unexpected:
        raise KeyError(
            f"the checkpoint's model parameters do not match this model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}; resume with the model (and actor.use_lora settings) the checkpoint "
            "was written for"
        )


def save_dcp(state: Mapping[str, Any], path: str | Path) -> None:
    """Every rank writes its shards of `state` under `path` (a directory)."""
    Path(path).mkdir(parents=True, exist_ok=True)
    with _single_process_quiet():
        dcp.save(dict(state), checkpoint_id=str(path))


def load_dcp(state: dict[str, Any], path: str | Path) -> None:
    """Fill `state` (a template: the engine's `state_dict()`, any sharding) in place from `path`."""
    if not Path(path).is_dir():
        raise ValueError(f"checkpoint {path} does not exist; pass a directory written by save_dcp")
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path))


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns when it runs without a process group; for one plain process that is the intent."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
