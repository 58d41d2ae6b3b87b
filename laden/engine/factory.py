"""Build the train engine that `actor.backend` names, from the resolved config: its backend object's
`build` (`laden.engine.backend`), each engine imported only when asked for."""

from __future__ import annotations

import os

import torch
from torch import nn

from laden.config import LadenConfig
from laden.engine.base import TrainEngine

__all__ = ["build_engine", "launched_world_size"]


def build_engine(
    cfg: LadenConfig, model: nn.Module, *, total_steps: int, device: torch.device
) -> TrainEngine:
    """The engine for `actor.backend`, with `actor.*` knobs mapped onto it."""
    from laden.engine.backend import resolve_backend

    return resolve_backend(cfg).build(cfg, model, total_steps=total_steps, device=device)


def launched_world_size() -> int:
    """Processes started by the launcher (torchrun sets WORLD_SIZE); 1 for a plain process."""
    return int(os.environ.get("WORLD_SIZE", "1"))
