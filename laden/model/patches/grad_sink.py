"""Weight gradients added straight into an fp32 accumulator by the module that computes them.

An engine that sums a bf16 weight's gradients over micro-batches in an fp32 accumulator (the
roundpipe residency) otherwise lets autograd write each micro-batch's gradient in bf16 and
then adds it into the accumulator: one more kernel per weight per micro-batch (a mixed-dtype
add, unvectorised) and one Python hook call. A module that computes its weight gradients
itself (the lean gated MLP) can do better: given the weight's `GradSink`, it hands the
gradient's two factors to the sink, which adds their product into the accumulator in one
GEMM with an fp32 output (`torch.addmm(acc, g^T, x, out_dtype=torch.float32, out=acc)`, on
CUDA in recent torch), and returns no gradient for the weight.

That GEMM keeps the product in fp32 instead of rounding it to bf16 first, so its sum is the
more exact one. Where that GEMM is not available (CPU, older torch) the sink computes the
product in the weight's dtype and adds it: the very values autograd's gradient and the fold
would give, so the two paths are identical there (and tested so).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

__all__ = ["GradSink", "accumulate_product", "attach_sink", "joint_sink", "sink_of", "suspended"]

_ATTR = "_laden_grad_sink"


class GradSink(Protocol):
    """Where a weight's gradient goes instead of `.grad`."""

    def accumulate(self, grad_out: torch.Tensor, inp: torch.Tensor, weight_dtype: torch.dtype) -> None:
        """Add `grad_out [N, out]^T @ inp [N, in]` (the weight's gradient) to the accumulator."""
        ...


_state = threading.local()


def joint_sink(sinks: Sequence[GradSink | None]) -> GradSink | None:
    """One sink for weights stacked by rows (`laden.model.patches.stacked.stacked_rows`) whose gradients
    go to `sinks`: it takes the stacked gradient's factors and adds them in one GEMM, if the
    sinks' class can join them (its `join(sinks)` returns a sink, e.g. accumulators that are
    stacked the same way); None otherwise, and the caller feeds each sink its own rows."""
    if not sinks or any(s is None for s in sinks):
        return None
    join = getattr(type(sinks[0]), "join", None)
    return join(sinks) if callable(join) else None


def sink_of(weight: torch.Tensor) -> GradSink | None:
    """The sink attached to `weight`, if any (none inside `suspended()`)."""
    if getattr(_state, "suspended", False):
        return None
    return getattr(weight, _ATTR, None)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Modules called inside return their weights' gradients as usual (this thread).

    For a caller that differentiates a module several times per backward and sums the
    gradients itself (the tiled MLP, once per tile): the engine then sees one gradient per
    backward, as it would without the module inside.
    """
    before = getattr(_state, "suspended", False)
    _state.suspended = True
    try:
        yield
    finally:
        _state.suspended = before


def attach_sink(weight: torch.Tensor, sink: GradSink) -> None:
    """Send `weight`'s gradient to `sink` from modules that honour sinks (the weight keeps it)."""
    setattr(weight, _ATTR, sink)


def accumulate_product(
    acc: torch.Tensor, grad_out: torch.Tensor, inp: torch.Tensor, weight_dtype: torch.dtype
) -> None:
    """`acc += grad_out^T @ inp`: in one fp32-output GEMM where there is one, else as autograd would
    compute the weight's gradient (in `weight_dtype`) followed by the add."""
    with torch.no_grad():
        if (
            acc.dtype == torch.float32
            and grad_out.dtype == inp.dtype
            and _fp32_out_addmm(acc.device, grad_out.dtype)
        ):
            torch.addmm(acc, grad_out.t(), inp, out_dtype=torch.float32, out=acc)
        else:
            acc.add_(grad_out.t().mm(inp).to(weight_dtype))


@functools.cache
def _fp32_out_addmm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch.addmm(fp32, low, low, out_dtype=float32, out=fp32)` runs here and adds right."""
    if dtype not in (torch.bfloat16, torch.float16) or device.type != "cuda":
        return False
    try:  # as the engine calls it: a transposed factor, the accumulator a view into a flat buffer
        g = torch.ones(8, 16, device=device, dtype=dtype)
        x = torch.ones(8, 24, device=device, dtype=dtype)
        flat = torch.ones(8 + 16 * 24, device=device, dtype=torch.float32)
        acc = flat[8:].view(16, 24)
        torch.addmm(acc, g.t(), x, out_dtype=torch.float32, out=acc)
        return bool((acc == 9).all()) and bool((flat[:8] == 1).all())
    except (TypeError, RuntimeError, NotImplementedError):
        return False
