"""Build the train engine that `actor.backend` names, from the resolved config."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from laden.config import AllocationMode, LadenConfig
from laden.engine.base import TrainEngine
from laden.engine.local import LocalEngine, OptimSettings, packed_loss_fn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def optim_settings(cfg: LadenConfig, total_steps: int) -> OptimSettings:
    o = cfg.actor.optimizer
    return OptimSettings(
        type=o.type,
        lr=o.lr,
        weight_decay=o.weight_decay,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        momentum=o.momentum,
        lr_scheduler_type=o.lr_scheduler_type,
        warmup_steps=math.ceil(o.warmup_steps_proportion * total_steps),
        min_lr_ratio=o.min_lr_ratio,
        total_steps=total_steps,
        gradient_clipping=o.gradient_clipping,
    )


def build_engine(
    cfg: LadenConfig, model: nn.Module, *, total_steps: int, device: torch.device
) -> TrainEngine:
    """The engine for `actor.backend`, with `actor.*` knobs mapped onto it."""
    mode = AllocationMode.parse(cfg.actor.backend)
    actor = cfg.actor
    settings = optim_settings(cfg, total_steps)
    loss_fn = packed_loss_fn(chunked=actor.chunked_loss, chunk_size=actor.loss_chunk_size)
    needs_fsdp = actor.fsdp.offload_params or actor.fsdp.per_layer_optim_step
    if mode.backend == "fsdp" and mode.num_gpus == 1 and launched_world_size() == 1 and not needs_fsdp:
        return LocalEngine(
            model,
            device=device,
            dtype=DTYPES[actor.dtype],
            optimizer_dtype=DTYPES[actor.optimizer_dtype],
            optim=settings,
            gradient_checkpointing=actor.gradient_checkpointing,
            loss_fn=loss_fn,
        )
    if mode.backend == "fsdp":
        return _build_fsdp(cfg, model, mode, settings, device)
    if mode.backend == "roundpipe":
        return _build_roundpipe(cfg, model, mode, settings, device)
    raise ValueError(
        f"actor.backend={cfg.actor.backend!r}: backend {mode.backend!r} has no engine; use fsdp or roundpipe"
    )


def launched_world_size() -> int:
    """Processes started by the launcher (torchrun sets WORLD_SIZE); 1 for a plain process."""
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


def _build_fsdp(
    cfg: LadenConfig, model: nn.Module, mode: Any, settings: OptimSettings, device
) -> TrainEngine:
    from laden.engine.fsdp import build_fsdp_engine

    return build_fsdp_engine(cfg, model, mode=mode, optim=settings, device=device)


def _build_roundpipe(
    cfg: LadenConfig, model: nn.Module, mode: Any, settings: OptimSettings, device
) -> TrainEngine:
    from laden.engine.roundpipe import build_roundpipe_engine

    return build_roundpipe_engine(cfg, model, mode=mode, optim=settings, device=device)
