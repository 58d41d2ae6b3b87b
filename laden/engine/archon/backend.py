"""The archon engine's backend object (`actor.backend: archon:...`, and `megatron:` modes, which run on
it): PyTorch's pipeline schedules with FSDP2, tensor, context and expert parallel. The planner has no
memory model for it yet: `laden plan` refuses it and its `auto` knobs take their memory-saving values."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from laden.config import LadenConfig
from laden.engine.backend import TrainBackend

if TYPE_CHECKING:
    from laden.engine.base import TrainEngine


class ArchonBackend(TrainBackend):
    name = "archon"

    def build(
        self, cfg: LadenConfig, model: nn.Module, *, total_steps: int, device: torch.device
    ) -> TrainEngine:
        from laden.engine.archon.factory import build_archon_engine
        from laden.optim import OptimSettings

        optim = OptimSettings.from_config(cfg.actor.optimizer, total_steps)
        return build_archon_engine(cfg, model, mode=self.mode, optim=optim, device=device)
