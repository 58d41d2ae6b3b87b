"""Mixture-of-Experts layers on the archon engine: set up, and which parameters stay out of FSDP.

With `e > 1` each rank keeps `E / e` experts (`laden.model.moe.apply_expert_parallel`); those
shards are left out of FSDP (`expert_params`). With `t > 1` a MoE block (router, experts, shared
experts) stays whole and plain on every tensor rank, which all route the same tokens, so its
other parameters are left out of FSDP too (`replicated_params`); they run under autocast when the
compute dtype differs from the stored one, since no FSDP gather casts them. The engine reduces
both kinds' gradients itself (`laden.engine.archon.grads`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from laden.model import moe


def setup_moe(
    model: nn.Module,
    *,
    ep_group: Any,
    tp: int,
    compute_dtype: torch.dtype,
    storage_dtype: torch.dtype,
    device_type: str,
    router_aux_loss_coef: float,
    capacity_factor: float | None,
) -> tuple[list[nn.Module], Any]:
    """The model's MoE blocks, split over `ep_group` (None: whole), and their router statistics
    (`laden.model.moe.enable_router_aux_loss`; None for a dense model)."""
    blocks = moe.moe_blocks(model)
    if not blocks:
        return blocks, None
    if tp > 1 and compute_dtype != storage_dtype:
        for block in blocks:  # left out of FSDP (whose gathers cast): autocast casts instead
            _run_under_autocast(block, device_type, compute_dtype)
    if ep_group is not None:
        moe.apply_expert_parallel(model, ep_group, capacity_factor=capacity_factor)
    elif capacity_factor:
        moe.apply_expert_parallel(model, None, capacity_factor=capacity_factor)
    return blocks, moe.enable_router_aux_loss(model, router_aux_loss_coef)


def expert_params(modules: list[Any]) -> list[nn.Parameter]:
    """The expert shards among these modules' parameters."""
    return [p for m in modules for p in m.parameters() if moe.expert_shard(p) is not None]


def replicated_params(
    modules: list[Any], blocks: list[nn.Module], experts: list[nn.Parameter]
) -> list[nn.Parameter]:
    """The MoE blocks' parameters among these modules' that are not expert shards (under `t > 1`)."""
    here = {id(p) for m in modules for p in m.parameters()}
    expert_ids = {id(p) for p in experts}
    block_params = {id(p): p for block in blocks for p in block.parameters()}
    return [p for i, p in block_params.items() if i in here and i not in expert_ids]


def _run_under_autocast(module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """`module`'s forward (this instance's) under autocast to `dtype`."""
    forward = module.forward

    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    module.forward = run  # type: ignore[method-assign]
