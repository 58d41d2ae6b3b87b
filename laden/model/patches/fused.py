"""Fused elementwise kernels for the lean RMSNorm and the lean gated MLP (`actor.fused_elementwise`).

The lean modules (`laden.model.patches.lean_norm`, `laden.model.patches.lean_mlp`) run Hugging Face's ops
one by one: an RMSNorm forward is eight kernels over the row (cast, square, mean, rsqrt,
multiply, cast back, weight multiply) and its backward about twenty, each reading and
writing the whole activation. On a GPU such memory-bound kernels, not the matmuls, took
half of the kernel time of the reference training step (`benchmarks/RESULTS.md`).

With `use_fused_kernels(True)` the same math goes through `torch.compile` (`fullgraph`,
dynamic token counts, static last dimensions: `use_static_last_dims`): one function for the
norm's forward, one for its backward, one for the SwiGLU product's backward (the product and
both input gradients in one pass). Only these pure tensor functions are compiled, never a
layer: no graph break at attention, no autograd tracing, and the guard check is the only
per-call cost. Results agree with the eager ops to float rounding (the compiler fuses and may
reorder a reduction), not bitwise, which is why it is a separate switch. It is process-wide: a
kernel choice, like PyTorch's backend flags.

On an H200 (`benchmarks/RESULTS.md`, Qwen3-1.7B, 8 micro-batches of 2 x 4096 tokens) the step's
kernel time fell from 2.54 to 1.90 s with it, and tokens/s rose by a fifth. The attention
layers' rotary embedding has its fused kernels in `laden.model.patches.fused_rotary`, behind the same
switch.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["call", "fused_kernels_enabled", "use_fused_kernels", "use_static_last_dims"]

_ENABLED = False
_STATIC_LAST_DIMS = True


def use_fused_kernels(enabled: bool = True) -> None:
    """Run the lean modules' elementwise math compiled (True) or as eager ops (False, the default)."""
    global _ENABLED
    _ENABLED = bool(enabled)


def fused_kernels_enabled() -> bool:
    return _ENABLED


def use_static_last_dims(enabled: bool = True) -> None:
    """Compile the fused functions with every tensor argument's last dimension fixed (the default).

    The functions compile with dynamic shapes, so one compilation serves every number of
    tokens; their last dimensions (hidden size, head dim, intermediate size) are model
    constants, and fixing them lets the compiler index and reduce with constant sizes instead
    of symbolic ones. A model with other sizes compiles once more per size. On an H200
    (`benchmarks/RESULTS.md`, seventh round) the reference step ran 4 to 5 % faster with it
    (35,835 and 36,615 tokens/s against 34,090 and 35,152); `False` goes back to fully
    dynamic shapes.
    """
    global _STATIC_LAST_DIMS
    _STATIC_LAST_DIMS = bool(enabled)


@functools.cache
def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    return torch.compile(fn, dynamic=True, fullgraph=True)


def _compile_errors() -> tuple[type[BaseException], ...]:
    try:
        from torch._dynamo.exc import TorchDynamoException
    except ImportError:  # pragma: no cover - depends on the installed torch
        return ()
    return (TorchDynamoException,)


_COMPILE_ERRORS = _compile_errors()


def _subclass(arg: Any) -> bool:
    return isinstance(arg, torch.Tensor) and type(arg) not in (torch.Tensor, torch.nn.Parameter)


_EAGER: set[Callable[..., Any]] = set()  # functions whose compilation failed: they run eager


def call(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, compiled once per function when fused kernels are on.

    A function the compiler cannot handle here (no triton for the GPU, no C++ compiler for the
    CPU, an unsupported construct) runs eager from then on, with one warning: the same values
    to float rounding, without the fusion. Errors of the computation itself are raised as usual.
    Tensor subclasses (tensor parallelism's DTensors) always run eager.
    """
    if not _ENABLED or fn in _EAGER or any(_subclass(a) for a in args):
        return fn(*args)
    if _STATIC_LAST_DIMS:
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() > 0:
                torch._dynamo.mark_static(a, a.dim() - 1)
    try:
        return _compiled(fn)(*args)
    except _COMPILE_ERRORS as error:
        _EAGER.add(fn)
        warnings.warn(
            f"fused kernels: {fn.__qualname__} did not compile ({type(error).__name__}: "
            f"{str(error).splitlines()[0][:300] if str(error) else ''}); it runs as eager ops from now on "
            "(actor.fused_elementwise=false avoids the attempt)",
            stacklevel=2,
        )
        return fn(*args)
