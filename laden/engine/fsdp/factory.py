"""Map the resolved `actor.*` configuration onto `FSDPEngine` (the trainer's entry point)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from laden.engine.fsdp.engine import FSDPEngine
from laden.model.dtypes import torch_dtype
from laden.optim import OptimSettings


def build_fsdp_engine(
    cfg: Any,
    model: nn.Module,
    *,
    mode: Any,
    optim: OptimSettings,
    device: torch.device,
    full_state_dict: dict[str, torch.Tensor] | None = None,
) -> FSDPEngine:
    """The engine for `actor.backend: fsdp:dXtYcZ` (`mode` is its parsed `AllocationMode`).

    One plain process (no torchrun) runs `fsdp:d1` without a process group. Under torchrun the
    process group must already be started (`init_distributed`). With
    `actor.fsdp.memory_efficient_load` rank 0 passes the real model (or `full_state_dict`) and
    the other ranks a model whose parameters are on the meta device. The default objective is
    `CrossEntropy(actor.chunked_loss, actor.loss_chunk_size)`.
    """
    actor = cfg.actor
    return FSDPEngine(
        model,
        dp=mode.dp,
        tp=mode.tp,
        cp=mode.cp,
        device=device,
        dtype=torch_dtype(actor.dtype),
        optimizer_dtype=torch_dtype(actor.optimizer_dtype),
        optim=optim,
        gradient_checkpointing=actor.gradient_checkpointing,
        offload_params=actor.fsdp.offload_params,
        per_layer_optim_step=actor.fsdp.per_layer_optim_step,
        optim_step_prefetch_layers=actor.fsdp.optim_step_prefetch_layers,
        memory_efficient_load=actor.fsdp.memory_efficient_load,
        full_state_dict=full_state_dict,
        chunked_loss=actor.chunked_loss,
        loss_chunk_size=actor.loss_chunk_size,
    )
