"""Fused elementwise kernels for the lean RMSNorm and the lean gated MLP (`actor.fused_elementwise`).

The lean modules (`laden.model.patches.lean_norm`, `laden.model.patches.lean_mlp`) run Hugging Face's ops
one by one: an RMSNorm forward is eight kernels over the row (cast, square, mean, rsqrt,
multiply, cast back, weight multiply) and its backward about twenty, each reading and
writing the whole activation. On a GPU such memory-bound kernels, not the matmuls, took
half of the kernel time of the reference training step (`benchmarks/RESULTS.md`).

With `PatchOptions(fused=True)` (`laden.model.patches.options`, stored on each patched module)
the same math goes through `torch.compile` (`fullgraph`, dynamic token counts, static last
dimensions unless `static_last_dims=False`): one function for the norm's forward, one for its
backward, one for the SwiGLU product's backward (the product and both input gradients in one
pass). Only these pure tensor functions are compiled, never a layer: no graph break at
attention, no autograd tracing, and the guard check is the only per-call cost. Results agree
with the eager ops to float rounding (the compiler fuses and may reorder a reduction), not
bitwise, which is why it is a separate option. It is per model, passed to `call` by the module
that runs: a fused model and an eager one can share a process.

On an H200 (`benchmarks/RESULTS.md`, Qwen3-1.7B, 8 micro-batches of 2 x 4096 tokens) the step's
kernel time fell from 2.54 to 1.90 s with it, and tokens/s rose by a fifth. The attention
layers' rotary embedding has its fused kernels in `laden.model.patches.fused_rotary`, behind the
same option.

Static last dimensions (the default): the functions compile with dynamic shapes, so one
compilation serves every number of tokens; their last dimensions (hidden size, head dim,
intermediate size) are model constants, and fixing them lets the compiler index and reduce with
constant sizes instead of symbolic ones. A model with other sizes compiles once more per size.
On an H200 (`benchmarks/RESULTS.md`, seventh round) the reference step ran 4 to 5 % faster with
them (35,835 and 36,615 tokens/s against 34,090 and 35,152); `static_last_dims=False` goes back
to fully dynamic shapes.

Process-wide state here is caches only, never a switch: the compiled code of each function (one
per function and last-dimension mode) and the functions that failed to compile (they run eager
from then on, whichever model calls them).
"""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

from laden.model.patches.options import PatchOptions

__all__ = ["call"]


@functools.cache
def _compiled(fn: Callable[..., Any], static_last_dims: bool) -> Callable[..., Any]:
    return torch.compile(_variant(fn, static_last_dims), dynamic=True, fullgraph=True)


def _variant(fn: Callable[..., Any], static_last_dims: bool) -> Callable[..., Any]:
    """`fn` itself for static last dimensions, else `fn` with a copy of its code object.

    Dynamo keeps compiled graphs on the code object, shared by every `torch.compile` of it, and
    its guards do not look at `mark_static`: a graph compiled for static last dimensions would
    serve an unmarked call of the same sizes, and a dynamic one a marked call. A second code
    object gives each mode its own graphs, so a model keeps the mode it asked for.
    """
    if static_last_dims or not isinstance(fn, types.FunctionType):
        return fn
    code = fn.__code__.replace()  # equal, but another object
    copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__qualname__, copy.__kwdefaults__, copy.__module__ = (
        fn.__qualname__,
        fn.__kwdefaults__,
        fn.__module__,
    )
    return copy


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


def call(fn: Callable[..., Any], *args: Any, options: PatchOptions) -> Any:
    """`fn(*args)`, compiled once per function (and last-dimension mode) with `options.fused`.

    A function the compiler cannot handle here (no triton for the GPU, no C++ compiler for the
    CPU, an unsupported construct) runs eager from then on, with one warning: the same values
    to float rounding, without the fusion. Errors of the computation itself are raised as usual.
    Tensor subclasses (tensor parallelism's DTensors) always run eager.
    """
    if not options.fused or fn in _EAGER or any(_subclass(a) for a in args):
        return fn(*args)
    if options.static_last_dims:
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() > 0:
                torch._dynamo.mark_static(a, a.dim() - 1)
    try:
        return _compiled(fn, options.static_last_dims)(*args)
    except _COMPILE_ERRORS as error:
        _EAGER.add(fn)
        warnings.warn(
            f"fused kernels: {fn.__qualname__} did not compile ({type(error).__name__}: "
            f"{str(error).splitlines()[0][:300] if str(error) else ''}); it runs as eager ops from now on "
            "(actor.fused_elementwise=false avoids the attempt)",
            stacklevel=2,
        )
        return fn(*args)
