"""Device, precision and recompute helpers every engine shares (one place, no per-engine copies).

Precision policy of a model resident on one device without FSDP: parameters (the master copy)
are stored in the optimizer dtype and the forward runs under autocast in the compute dtype, so
weights are cast per matmul (the price of keeping a single fp32 copy). When the two dtypes are
equal (`adam_bf16`'s bf16 masters, or fp32 compute) nothing is cast and autocast stays off.
"""

from __future__ import annotations

import contextlib
import functools
from contextlib import AbstractContextManager
from typing import Any

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


def trim_host_heap() -> None:
    """Hand the C allocator's free heap pages back to the OS (glibc's `malloc_trim(0)`; nothing elsewhere).

    A training step on the CPU frees its activations into glibc's heap, which keeps most of them:
    after two steps of a 135M-parameter model (512 tokens a micro-batch), 0.52 GiB of free heap
    stayed resident, and generation afterwards peaked that much higher than its live tensors
    (`benchmarks/RESULTS.md`, `laden plan` on the CPU). Trimming takes milliseconds; the next step
    faults the pages in again, which is small next to a CPU step.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): no trim to call
        return None
