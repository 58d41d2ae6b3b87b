"""Run a function on N local processes with a gloo process group (CPU tests of the parallel modes).

Every parallel mode of the `fsdp` backend has a CPU test: the same collectives run over
gloo on loopback, so correctness (d2 == d1, c2 == c1, t2 == t1, resharded resume) is
checked without GPUs. Each rank's return value comes back through a file.

Every rank is a process of its own that has run nothing yet, as torchrun gives. On gloo the
ranks are forked from a `forkserver`: a fresh interpreter that imports torch, transformers and
laden (`PRELOAD`) once for the whole test session and does nothing else; each rank then takes
the caller's environment, working directory and `sys.path`. A `spawn`ed rank would import those
modules again, several seconds of CPU per rank and call, most of a CPU test's time. With NCCL
the ranks are `spawn`ed (a process that may have touched CUDA must not be forked).

A worker that runs longer than `LADEN_WORKER_TIMEOUT_S` seconds (default 600) prints every
thread's stack to stderr and exits, so a collective that never completes shows where each
rank waits instead of hanging the test run; one that crashes prints its stack before it dies.
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

# Imported once in the forkserver (a module that fails to import is skipped there, and imported by the
# rank that needs it instead).
PRELOAD = [
    "pytest",
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "laden.data",
    "laden.engine.fsdp",
    "laden.engine.archon",
    "laden.engine.roundpipe",
    "laden.roundpipe",
    "laden.engine.checkpoint",
    "laden.sft.trainer",
    "laden.rl.trainer",
]
FORKSERVER = "forkserver" in mp.get_all_start_methods()
if FORKSERVER:
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)


def _worker(
    rank: int, world_size: int, out_dir: str, backend: str, fn: Callable, args: tuple, env: dict[str, str]
) -> None:
    os.environ.clear()  # the caller's environment, not the one the forkserver started with
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    faulthandler.enable()  # a rank that crashes (SIGSEGV, SIGABRT) prints its Python stack first
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
    """`fn(rank, world_size, *args)` on `world_size` new processes; their return values by rank.

    `fn` must be importable by name (a module-level function). A failing rank raises here.
    With an NCCL `backend` (e.g. `"cpu:gloo,cuda:nccl"`) rank r uses GPU r.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_args = (world_size, out_dir, backend, fn, args, dict(os.environ))
        start = "forkserver" if FORKSERVER and "nccl" not in backend else "spawn"
        mp.start_processes(_worker, args=spawn_args, nprocs=world_size, join=True, start_method=start)
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
