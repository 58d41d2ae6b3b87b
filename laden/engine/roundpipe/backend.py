"""The roundpipe engine's backend object (`actor.backend: roundpipe:dN`): model states in host memory,
the GPU holding two pipeline stages at a time; it recomputes by design and packs batches on the host."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from laden.config import LadenConfig
from laden.engine.backend import TrainBackend, model_load_kwargs

if TYPE_CHECKING:
    from laden.engine.base import TrainEngine
    from laden.engine.estimates import MemoryEstimator
    from laden.engine.runtime import Runtime

log = logging.getLogger("laden.runtime")


class RoundPipeBackend(TrainBackend):
    name = "roundpipe"
    batches_on_host = True
    keeps_policy_on_host = True
    recomputes_by_design = True

    def min_micro_batches(self, cfg: LadenConfig) -> int:
        """`actor.mb_spec.n_mbs`, raised to `actor.roundpipe.num_microbatch` (the pipeline overlaps the
        stages of different micro-batches)."""
        return max(cfg.actor.mb_spec.n_mbs, cfg.actor.roundpipe.num_microbatch or 0)

    def load_model(self, cfg: LadenConfig, rt: Runtime) -> nn.Module:
        """A random init (`actor.init_from_config`) is built on the meta device and filled layer by layer
        on the GPU by the engine (`_meta_init`); otherwise read as every engine does."""
        if not _meta_init(cfg, rt):
            return super().load_model(cfg, rt)
        from laden.engine.roundpipe.host.memory import meta_params
        from laden.model.hf.loading import skeleton_causal_lm

        # An 8B random init on one host core takes minutes; on the GPU, seconds.
        log.info("actor.init_from_config: %s built on the meta device, initialised on %s by the roundpipe "
                 "engine (seed %d)", cfg.actor.path, rt.device, cfg.seed)  # fmt: skip
        torch.cuda.manual_seed(cfg.seed)
        kwargs = model_load_kwargs(cfg)
        with meta_params():
            return skeleton_causal_lm(
                cfg.actor.path, dtype=kwargs["dtype"], attn_impl=kwargs["attn_impl"], device="cpu"
            )

    def build(
        self, cfg: LadenConfig, model: nn.Module, *, total_steps: int, device: torch.device
    ) -> TrainEngine:
        from laden.engine.roundpipe.engine import build_roundpipe_engine
        from laden.optim import OptimSettings

        optim = OptimSettings.from_config(cfg.actor.optimizer, total_steps)
        return build_roundpipe_engine(cfg, model, mode=self.mode, optim=optim, device=device)

    def training_estimator(self, model: Any = None, gpu_capacity: int | None = None) -> MemoryEstimator:
        from laden.engine.roundpipe.estimate import RoundPipeTraining

        return RoundPipeTraining(model, gpu_capacity)

    def frozen_estimator(self, model: Any = None) -> MemoryEstimator:
        from laden.engine.roundpipe.estimate import RoundPipeFrozen

        return RoundPipeFrozen(model)

    def host_oom_fixes(self, cfg: LadenConfig) -> list[str]:
        rp, fixes = cfg.actor.roundpipe, []
        if rp.pin_model == "alloc":
            fixes.append(
                "actor.roundpipe.pin_model=register (about 1x the model in pinned host memory instead of 1.5x)"
            )
        elif rp.pin_model == "register":
            fixes.append("actor.roundpipe.pin_model=off (weights paged in on demand)")
        fixes.append(
            "fewer micro-batches per step (actor.mb_spec.max_tokens_per_mb larger, or actor.roundpipe.num_microbatch "
            "smaller): each micro-batch's stage activations are parked in host memory"
        )
        if rp.optim_step == "async":
            fixes.append("actor.roundpipe.optim_step=sync (no second upload buffer and gradient inbox)")
        return fixes + super().host_oom_fixes(cfg)


def _meta_init(cfg: LadenConfig, rt: Runtime) -> bool:
    """A random init the engine runs on the GPU, from a meta skeleton: one process with a CUDA device,
    no LoRA adapters (their init is peft's), a config.json."""
    path = Path(cfg.actor.path)
    return (
        cfg.actor.init_from_config and rt.world_size == 1 and torch.device(rt.device).type == "cuda"
        and not cfg.actor.use_lora and path.is_dir() and (path / "config.json").is_file()
    )  # fmt: skip
