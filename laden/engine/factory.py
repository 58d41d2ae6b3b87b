"""Build the train engine that `actor.backend` names, from the resolved config.

Every `fsdp` allocation builds `FSDPEngine` (one plain process for `fsdp:d1` without torchrun,
FSDP2 under a process group otherwise); `roundpipe` builds `RoundPipeEngine`, `archon` (and
`megatron`, which runs on it) `ArchonEngine`, each imported only when asked for.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from laden.config import AllocationMode, LadenConfig
from laden.engine.base import TrainEngine
from laden.optim import OptimSettings

__all__ = ["build_engine", "launched_world_size"]


def build_engine(
    cfg: LadenConfig, model: nn.Module, *, total_steps: int, device: torch.device
) -> TrainEngine:
    """The engine for `actor.backend`, with `actor.*` knobs mapped onto it."""
    mode = AllocationMode.parse(cfg.actor.backend)
    settings = OptimSettings.from_config(cfg.actor.optimizer, total_steps)
    if mode.backend == "fsdp":
        from laden.engine.fsdp import build_fsdp_engine

        return build_fsdp_engine(cfg, model, mode=mode, optim=settings, device=device)
    if mode.backend == "roundpipe":
        from laden.engine.roundpipe import build_roundpipe_engine

        return build_roundpipe_engine(cfg, model, mode=mode, optim=settings, device=device)
    if mode.backend in ("archon", "megatron"):
        from laden.engine.archon import build_archon_engine

        return build_archon_engine(cfg, model, mode=mode, optim=settings, device=device)
    raise ValueError(
        f"actor.backend={cfg.actor.backend!r}: backend {mode.backend!r} has no engine; use fsdp, roundpipe or archon"
    )


def launched_world_size() -> int:
    """Processes started by the launcher (torchrun sets WORLD_SIZE); 1 for a plain process."""
    return int(os.environ.get("WORLD_SIZE", "1"))
