"""Memory-efficient model load (`actor.fsdp.memory_efficient_load`): weights broadcast from rank 0.

Every rank shards a model whose parameters are on the meta device; rank 0 alone holds the
pretrained weights on the host, and `set_model_state_dict(..., broadcast_from_rank0=True)`
sends one tensor at a time to the other ranks, which keep only their shard. Host peak: one
model on rank 0 and none elsewhere (instead of one per rank); device peak: the shard plus
one full tensor in flight. The cost is start-up time: every tensor crosses the network
once from rank 0 instead of being read from disk by each rank in parallel.

Buffers (RoPE tables) are small and computed on every rank: the skeleton is built with
parameters on meta and buffers real (`build_meta_model`), they are saved before the
parameters are allocated and put back afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict


def release_params_to_meta(model: nn.Module) -> None:
    """Replace every parameter by a meta tensor of the same shape (tied parameters stay tied)."""
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.is_meta:
                continue
            if id(param) not in replaced:
                meta = torch.empty_like(param, device="meta")
                replaced[id(param)] = nn.Parameter(meta, requires_grad=param.requires_grad)
            module._parameters[name] = replaced[id(param)]


def real_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of all materialised buffers, persistent or not (small: RoPE tables, masks)."""
    return {n: b.detach().clone() for n, b in model.named_buffers() if not b.is_meta}


def materialize_and_broadcast(
    model: nn.Module,
    full_state_dict: dict[str, torch.Tensor] | None,
    buffers: dict[str, torch.Tensor],
    param_device: torch.device,
    buffer_device: torch.device,
) -> None:
    """Allocate the (sharded, meta) parameters on `param_device` and fill them from rank 0's weights."""
    model.to_empty(device=param_device)
    for fqn, value in buffers.items():
        owner, _, name = fqn.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._buffers[name] = value.to(buffer_device)
    missing = [n for n, b in model.named_buffers() if n not in buffers and b.is_meta]
    if missing:
        raise RuntimeError(f"buffers {missing} were never materialised; build the model with real buffers")
    state: dict[str, Any] | None = full_state_dict if dist.get_rank() == 0 else {}
    if dist.get_rank() == 0 and state is None:
        raise RuntimeError("memory_efficient_load: rank 0 must hold the full state dict")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, state or {}, options=options)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside the block is moved to the meta device (buffers stay real)."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            meta = torch.empty_like(param, device="meta")
            module._parameters[name] = nn.Parameter(meta, requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def build_meta_model(path: str | Path, *, dtype: torch.dtype, attn_impl: str = "auto") -> nn.Module:
    """The causal LM of `path`/config.json with parameters on meta and real buffers (no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from laden.model.attention import set_attention

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    set_attention(model, attn_impl)  # type: ignore[arg-type]
    return model


def load_model_for_rank(
    path: str,
    *,
    dtype: torch.dtype,
    memory_efficient_load: bool,
    init_from_config: bool = False,
    seed: int = 0,
    attn_impl: str = "auto",
) -> nn.Module:
    """What this rank passes to `FSDPEngine`: the loaded model, or (memory-efficient, rank > 0) a meta skeleton."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if memory_efficient_load and rank > 0:
        return build_meta_model(path, dtype=dtype, attn_impl=attn_impl)
    from laden.model.hf.loading import load_causal_lm

    return load_causal_lm(
        path,
        dtype=dtype,
        init_from_config=init_from_config,
        seed=seed,
        attn_impl=attn_impl,  # type: ignore[arg-type]
    )
