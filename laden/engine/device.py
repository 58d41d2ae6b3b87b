"""Device, precision and recompute helpers every engine shares (one place, no per-engine copies).

Precision policy of a model resident on one device without FSDP: parameters (the master copy)
are stored in the optimizer dtype and the forward runs under autocast in the compute dtype, so
weights are cast per matmul (the price of keeping a single fp32 copy). When the two dtypes are
equal (`adam_bf16`'s bf16 masters, or fp32 compute) nothing is cast and autocast stays off.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch
from torch import nn


def default_device() -> torch.device:
    """The current CUDA device when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def autocast_context(
    device: torch.device, param_dtype: torch.dtype, compute_dtype: torch.dtype
) -> AbstractContextManager:
    """Autocast only when the stored parameters are wider than the compute dtype."""
    if param_dtype == compute_dtype or compute_dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=compute_dtype)


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Per-decoder-layer activation recompute (non-reentrant), across transformers 5.x names."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
