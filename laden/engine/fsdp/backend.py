"""The fsdp engine's backend object (`actor.backend: fsdp:dXtYcZ`): FSDP2 over the data, tensor and
context ranks, or one plain process for `fsdp:d1`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from laden.config import LadenConfig
from laden.engine.backend import TrainBackend, model_load_kwargs

if TYPE_CHECKING:
    from laden.engine.base import TrainEngine
    from laden.engine.estimates import MemoryEstimator
    from laden.engine.runtime import Runtime


class FsdpBackend(TrainBackend):
    name = "fsdp"

    def load_model(self, cfg: LadenConfig, rt: Runtime) -> nn.Module:
        """Under torchrun with `actor.fsdp.memory_efficient_load`, rank 0 reads the weights and the
        others build a meta skeleton (`load_model_for_rank`)."""
        if rt.world_size == 1:
            return super().load_model(cfg, rt)
        from laden.engine.fsdp.load import load_model_for_rank

        return load_model_for_rank(
            cfg.actor.path,
            memory_efficient_load=cfg.actor.fsdp.memory_efficient_load,
            **model_load_kwargs(cfg),
        )

    def build(
        self, cfg: LadenConfig, model: nn.Module, *, total_steps: int, device: torch.device
    ) -> TrainEngine:
        from laden.engine.fsdp.factory import build_fsdp_engine
        from laden.optim import OptimSettings

        optim = OptimSettings.from_config(cfg.actor.optimizer, total_steps)
        return build_fsdp_engine(cfg, model, mode=self.mode, optim=optim, device=device)

    def training_estimator(self, model: Any = None, gpu_capacity: int | None = None) -> MemoryEstimator:
        from laden.engine.fsdp.estimate import FsdpTraining

        return FsdpTraining(model)

    def frozen_estimator(self, model: Any = None) -> MemoryEstimator:
        from laden.engine.fsdp.estimate import FsdpFrozen

        return FsdpFrozen(model)

    def oom_fixes(self, cfg: LadenConfig, *, tokens_per_mb: int, longest_seq: int) -> list[str]:
        fixes = super().oom_fixes(cfg, tokens_per_mb=tokens_per_mb, longest_seq=longest_seq)
        if not cfg.actor.fsdp.offload_params:
            fixes.append(
                "actor.fsdp.offload_params=true, or actor.backend=roundpipe:d1 (model state in host memory; the "
                "slowest fix: weights and gradients cross PCIe every step and the optimizer runs on the host)"
            )
        return fixes
