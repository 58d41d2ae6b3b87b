"""Run a function on N local processes with a gloo process group (CPU tests of the parallel modes).

Every parallel mode of the `fsdp` backend has a CPU test: the same collectives run over
gloo on loopback, so correctness (d2 == d1, c2 == c1, t2 == t1, resharded resume) is
checked without GPUs. Processes are started with `spawn` (a clean interpreter, as torchrun
gives) and each one's return value comes back through a file.

A worker that runs longer than `LADEN_WORKER_TIMEOUT_S` seconds (default 600) prints every
thread's stack to stderr and exits, so a collective that never completes shows where each
rank waits instead of hanging the test run.
"""

from __future__ import annotations

import faulthandler
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, out_dir: str, backend: str, fn: Callable, args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    faulthandler.dump_traceback_later(float(os.environ.get("LADEN_WORKER_TIMEOUT_S", "600")), exit=True)
    torch.set_num_threads(1)
    if "nccl" in backend:
        torch.cuda.set_device(rank)
    # Rendezvous through a file in the run's own directory: no TCP port to pick and race for.
    store = f"file://{Path(out_dir) / 'rendezvous'}"
    dist.init_process_group(backend, init_method=store, rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo") -> list[Any]:
    """`fn(rank, world_size, *args)` on `world_size` spawned processes; their return values by rank.

    `fn` must be importable by name (a module-level function). A failing rank raises here.
    With an NCCL `backend` (e.g. `"cpu:gloo,cuda:nccl"`) rank r uses GPU r.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_args = (world_size, out_dir, backend, fn, args)
        mp.spawn(_worker, args=spawn_args, nprocs=world_size, join=True)
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
