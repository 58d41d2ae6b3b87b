"""Process-group start-up, and the `(dp, cp, tp)` device mesh of the `fsdp` engine.

`laden sft` runs under `torchrun` (one process per GPU, one or many nodes); this module
reads torchrun's environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
`MASTER_PORT`) and starts `torch.distributed`: NCCL for CUDA tensors, gloo for CPU tensors
(both at once on a GPU machine, so host-side collectives such as checkpoint planning work
too). Without torchrun's variables nothing is started and the caller runs one plain process.
A process group started here is destroyed at interpreter exit (`atexit`), before C++ static
destruction: left to it, gloo's worker threads were torn down there and now and then aborted
a process after its work was done ("terminate called without an active exception").

Mesh layout: `("dp", "cp", "tp")`, tensor parallel innermost so that its all-reduces stay
on the fastest links (the GPUs of one node), then Ulysses context parallel (two
all-to-alls per attention), data parallel outermost. FSDP shards parameters over the
flattened `"dp_cp"` axis: context-parallel ranks hold the same parameters and see
different tokens of the same sequences, so to the sharding they are data-parallel ranks.
The archon engine lays out its own five-axis mesh (`laden.engine.archon.engine`) on the
process group started here.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_AXES = ("dp", "cp", "tp")
"""Names of the mesh axes, outermost first."""
SHARD_AXIS = "dp_cp"
"""Flattened data x context axis over which FSDP shards parameters and averages gradients."""


def default_backend() -> str:
    """`nccl` for CUDA tensors plus `gloo` for CPU tensors on a GPU machine; `gloo` on a CPU-only one."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(
    backend: str | None = None, *, timeout_s: float = 1800.0
) -> tuple[int, int, int, torch.device]:
    """Start `torch.distributed` from torchrun's environment; return (rank, world_size, local_rank, device).

    Without `WORLD_SIZE` in the environment this is a single plain process: nothing is
    started and `(0, 1, 0, device)` is returned. An already started process group is reused.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _local_device(local_rank, backend)
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), local_rank, device
    if "WORLD_SIZE" not in os.environ:
        return 0, 1, 0, device
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set but {', '.join(missing)} is not; "
            "launch laden with torchrun (e.g. `torchrun --nproc_per_node 8 -m laden.cli sft ...`)"
        )
    backend = backend or default_backend()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    atexit.register(_destroy_process_group)
    return dist.get_rank(), dist.get_world_size(), local_rank, device


def start_single_process_group() -> None:
    """A world of one on a private in-memory store, so FSDP's offload policy can run in one process
    (`actor.fsdp.offload_params` without torchrun)."""
    dist.init_process_group(backend=default_backend(), store=dist.HashStore(), rank=0, world_size=1)


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _local_device(local_rank: int, backend: str | None) -> torch.device:
    if backend == "gloo" or not torch.cuda.is_available():
        return torch.device("cpu")
    num_gpus = torch.cuda.device_count()
    if local_rank >= num_gpus:
        raise RuntimeError(
            f"LOCAL_RANK={local_rank} but this node has {num_gpus} GPUs; "
            f"start at most {num_gpus} processes per node (torchrun --nproc_per_node {num_gpus})"
        )
    return torch.device("cuda", local_rank)


@dataclass(frozen=True, slots=True)
class ParallelMesh:
    """The `("dp", "cp", "tp")` device mesh and its flattened `dp_cp` shard axis."""

    root: DeviceMesh
    """The 3-D mesh, axes `MESH_AXES`."""
    shard: DeviceMesh
    """The flattened `dp x cp` axis FSDP shards parameters over."""

    def axis(self, name: str) -> DeviceMesh:
        """The 1-D sub-mesh `dp`, `cp`, `tp` or `dp_cp`."""
        return self.shard if name == SHARD_AXIS else self.root[name]

    def size(self, name: str) -> int:
        return self.axis(name).size()

    def local_rank(self, name: str) -> int:
        """This rank's index along axis `name`."""
        return self.axis(name).get_local_rank()

    def group(self, name: str) -> dist.ProcessGroup:
        return self.axis(name).get_group()


def build_device_mesh(dp: int, tp: int, cp: int, device_type: str) -> ParallelMesh:
    """A `("dp", "cp", "tp")` mesh over all ranks plus the flattened `"dp_cp"` shard axis.

    Raises ValueError when `dp * cp * tp` differs from the world size.
    """
    for name, size in (("dp", dp), ("tp", tp), ("cp", cp)):
        if size < 1:
            raise ValueError(f"{name}={size}: mesh sizes must be at least 1")
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if dp * cp * tp != world_size:
        raise ValueError(
            f"actor.backend asks for d{dp} x c{cp} x t{tp} = {dp * cp * tp} processes but "
            f"{world_size} were started; start {dp * cp * tp} (torchrun --nproc_per_node ...) "
            f"or change actor.backend so that d * c * t = {world_size}"
        )
    if not dist.is_initialized():
        raise RuntimeError("build_device_mesh needs a started process group; call init_distributed() first")
    mesh = init_device_mesh(device_type, (dp, cp, tp), mesh_dim_names=MESH_AXES)
    # `_flatten` is the (private but stable since torch 2.4) way to get one group over dp x cp.
    return ParallelMesh(root=mesh, shard=mesh[("dp", "cp")]._flatten(SHARD_AXIS))
