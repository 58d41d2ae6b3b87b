"""Resumable training checkpoints for single-process engines.

A checkpoint is one directory `step_<N>/` holding `state.pt` (engine state: model,
optimizer, LR scheduler), `trainer.json` (step, data-iterator position) and `rng.pt`
(Python, NumPy, torch CPU and CUDA generators). It is written into a temporary directory
and renamed into place, so a crash mid-save never leaves a half checkpoint that resume
would pick up. Resuming restores every generator, which is what makes resumed ==
uninterrupted bitwise on the CPU. Trade-off: `torch.save` of the full state is simple and
exact but holds one host copy of the state while writing; the sharded engines use
`torch.distributed.checkpoint` instead.
"""

from __future__ import annotations

import json
import random
import shutil
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


def save_checkpoint(
    ckpt_root: Path, *, step: int, engine_state: dict[str, Any], trainer_state: dict[str, Any], keep_last: int
) -> Path:
    """Atomically write checkpoint `step` under `ckpt_root` and prune to the newest `keep_last`."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"{_PREFIX}{step}"
    tmp = ckpt_root / f".tmp_{_PREFIX}{step}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    torch.save(engine_state, tmp / "state.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "trainer.json").write_text(json.dumps({"step": step, **trainer_state}, indent=2))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in list_checkpoints(ckpt_root)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old)
    return final


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints under `ckpt_root`, oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)]
    found = [p for p in found if (p / "trainer.json").exists()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))


def load_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return (engine_state, trainer_state) and restore the RNG state saved with them."""
    engine_state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    trainer_state = json.loads((path / "trainer.json").read_text())
    set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    return engine_state, trainer_state
