"""Resumable training checkpoints.

A checkpoint is one directory `step_<N>/` holding the engine's state (`engine/`: model,
optimizer, LR scheduler; a `torch.save` file for single-process engines, a
`torch.distributed.checkpoint` directory for sharded ones, which reshards on load),
`trainer.json` (step, data-iterator position) and `rng_rank<R>.pt` (Python, NumPy, torch
CPU and CUDA generators of every rank). Everything is written into a temporary directory
that rank 0 renames into place after all ranks finished, so a crash mid-save never leaves a
half checkpoint that resume would pick up. Restoring every generator is what makes resumed
== uninterrupted bitwise on the CPU.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

_PREFIX = "step_"


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_engine(engine: Any, path: Path, *, rank: int = 0) -> None:
    """Sharded engines write their own (collective) checkpoint; others (single process, or identical
    data-parallel replicas) a single `torch.save` file, written by rank 0."""
    if hasattr(engine, "save_checkpoint"):
        engine.save_checkpoint(path)
    elif rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        torch.save(engine.state_dict(), path / "state.pt")


def load_engine(engine: Any, path: Path) -> None:
    if hasattr(engine, "load_checkpoint"):
        engine.load_checkpoint(path)
    else:
        engine.load_state_dict(torch.load(path / "state.pt", map_location="cpu", weights_only=False))


def save_checkpoint(
    ckpt_root: Path,
    *,
    step: int,
    engine: Any,
    trainer_state: dict[str, Any],
    keep_last: int,
    rank: int = 0,
    barrier: Callable[[], None] = lambda: None,
) -> Path:
    """Atomically write checkpoint `step` under `ckpt_root` (every rank calls this) and prune old ones."""
    final = ckpt_root / f"{_PREFIX}{step}"
    tmp = ckpt_root / f".tmp_{_PREFIX}{step}"
    if rank == 0:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier()
    save_engine(engine, tmp / "engine", rank=rank)
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    barrier()
    if rank == 0:
        (tmp / "trainer.json").write_text(json.dumps({"step": step, **trainer_state}, indent=2))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in list_checkpoints(ckpt_root)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old)
    barrier()
    return final


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints under `ckpt_root`, oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)]
    found = [p for p in found if (p / "trainer.json").exists()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))


def load_checkpoint(path: Path, engine: Any, *, rank: int = 0) -> dict[str, Any]:
    """Restore the engine and this rank's RNG state; return the trainer state."""
    load_engine(engine, path / "engine")
    rng_file = path / f"rng_rank{rank}.pt"
    if rng_file.exists():  # a different world size has no file for this rank: keep the seeded state
        set_rng_state(torch.load(rng_file, weights_only=False))
    return json.loads((path / "trainer.json").read_text())
