"""Map the resolved `actor.*` configuration onto `ArchonEngine` (`archon:` and `megatron:` modes)."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from laden.config.alloc import archon_layout
from laden.engine.archon.engine import ArchonEngine
from laden.model.dtypes import torch_dtype
from laden.optim import OptimSettings

log = logging.getLogger("laden.archon")

DEFAULT_VIRTUAL_STAGES = 2
"""Looped stages per rank under `Interleaved1F1B` when `actor.archon.pp_layers_per_stage` is unset."""


def build_archon_engine(
    cfg: Any, model: nn.Module, *, mode: Any, optim: OptimSettings, device: torch.device
) -> ArchonEngine:
    """The engine for `actor.backend: archon:dXpYeZ` (or a `megatron:` mode, with one warning)."""
    actor, archon = cfg.actor, cfg.actor.archon
    if mode.backend == "megatron":
        log.warning(
            "actor.backend=%r: laden has no Megatron-Core; the mode runs on the archon engine (PyTorch's "
            "pipeline schedules, FSDP2, tensor and expert parallel) with the same d, p, t and e", actor.backend
        )  # fmt: skip
    if actor.use_lora:
        raise ValueError(
            "actor.use_lora=true is not supported by the archon engine; use actor.backend: fsdp:dN"
        )
    dp, pp, ep = archon_layout(mode)
    _warn_moe_settings_on_a_dense_model(cfg, model, ep)
    config: Any = model.config
    coef = archon.router_aux_loss_coef
    if coef is None:
        coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    # Hugging Face's coefficient multiplies top_k times laden's per-layer loss (laden.model.moe)
    coef *= int(getattr(config, "num_experts_per_tok", 1) or 1)
    return ArchonEngine(
        model, dp=dp, pp=pp, ep=ep, tp=mode.tp, cp=mode.cp, device=device, dtype=torch_dtype(actor.dtype),
        optimizer_dtype=torch_dtype(actor.optimizer_dtype), optim=optim, schedule=archon.pp_schedule,
        virtual_stages=virtual_stages(archon, model, pp), gradient_checkpointing=actor.gradient_checkpointing is True,
        chunked_loss=actor.chunked_loss, loss_chunk_size=actor.loss_chunk_size,
        plan_tokens=int(actor.mb_spec.max_tokens_per_mb or cfg.train_dataset.max_length or 4096), router_aux_loss_coef=coef,
        capacity_factor=archon.moe_capacity_factor,
    )  # fmt: skip


def _warn_moe_settings_on_a_dense_model(cfg: Any, model: nn.Module, ep: int) -> None:
    """The Mixture-of-Experts settings this run sets, named in one warning when the model has no
    experts for them to act on (a field that is parsed does something, or the run says it does not)."""
    from laden.model import moe

    if moe.moe_blocks(model):
        return
    archon = cfg.actor.archon
    unused = [f"actor.archon.{name}={getattr(archon, name)}" for name in ("router_aux_loss_coef", "moe_capacity_factor")
              if getattr(archon, name) is not None]  # fmt: skip
    if ep > 1:
        unused.append(f"expert parallel e{ep} in actor.backend={cfg.actor.backend!r}")
    if unused:
        log.warning(
            "%s: %s has no Mixture-of-Experts layers, so these do nothing; leave them unset for a dense model",
            ", ".join(unused), type(model).__name__,
        )  # fmt: skip


def virtual_stages(archon: Any, model: nn.Module, pp: int) -> int:
    """Looped stages per rank: 1 but under `Interleaved1F1B`, where `pp_layers_per_stage` sets it."""
    if archon.pp_schedule != "Interleaved1F1B":
        return 1
    if archon.pp_layers_per_stage is None:
        return DEFAULT_VIRTUAL_STAGES
    config: Any = model.config
    layers = int(config.num_hidden_layers)
    return max(1, math.ceil(layers / (pp * archon.pp_layers_per_stage)))
