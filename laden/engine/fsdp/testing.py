"""Run a function on N local processes with a gloo process group (CPU tests of the parallel modes).

Every parallel mode of the `fsdp` backend has a CPU test: the same collectives run over
gloo on loopback, so correctness (d2 == d1, c2 == c1, t2 == t1, resharded resume) is
checked without GPUs. Processes are started with `spawn` (a clean interpreter, as torchrun
gives) and each one's return value comes back through a file.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, world_size: int, port: int, out_dir: str, backend: str, fn: Callable, args: tuple
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    if "nccl" in backend:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo") -> list[Any]:
    """`fn(rank, world_size, *args)` on `world_size` spawned processes; their return values by rank.

    `fn` must be importable by name (a module-level function). A failing rank raises here.
    With an NCCL `backend` (e.g. `"cpu:gloo,cuda:nccl"`) rank r uses GPU r.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_args = (world_size, free_port(), out_dir, backend, fn, args)
        mp.spawn(_worker, args=spawn_args, nprocs=world_size, join=True)
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
