"""Attention projections that add their weight gradients straight into a `GradSink`.

The lean gated MLP hands its three weights' gradients to their sinks (`laden.model.grad_sink`);
the attention layer's four projections (`q_proj`, `k_proj`, `v_proj`, `o_proj`) are plain
`nn.Linear`s, whose gradients autograd writes in bf16 for the roundpipe residency to add into
their fp32 accumulators: for Qwen3-1.7B that add is most of what is left of the fold, about
0.1 s of a 2 s step on an H200. `enable_sink_linears` re-classes those projections (a
`laden.model.swap.ClassSwap`, so parameters, names and state dicts stay as they are) so that,
when the weight carries a sink and autograd records the call, the linear runs as one autograd
function whose backward gives the input's gradient as autograd's linear does and passes the
weight gradient's two factors to the sink, which adds their product into the accumulator in
one fp32-output GEMM on CUDA. Without a sink (any engine but roundpipe, or inside
`grad_sink.suspended()`), under autocast, or with an input in another dtype than the weight,
the projection is exactly `nn.Linear`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from laden.model.grad_sink import GradSink, sink_of
from laden.model.swap import ClassSwap, decoder_layers, plain_linear, warn_skipped

__all__ = ["disable_sink_linears", "enable_sink_linears", "is_sink_linear"]

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_ORIGINAL_CLASS_ATTR = "_laden_sink_linear_original_class"


class _SinkLinearFn(torch.autograd.Function):
    """`F.linear(x, weight, bias)` whose weight gradient goes to `sink` (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sink: GradSink):
        ctx.save_for_backward(x, weight)
        ctx.sink = sink
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_out.matmul(weight) if need_x else None  # autograd's linear: the same matmul
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        if need_w:
            ctx.sink.accumulate(rows, x.reshape(-1, x.shape[-1]), weight.dtype)
        grad_b = rows.sum(0) if need_b else None
        return grad_x, None, grad_b, None


def _sink_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    sink = sink_of(weight) if torch.is_grad_enabled() and weight.requires_grad else None
    if sink is None or x.dtype != weight.dtype or torch.is_autocast_enabled(x.device.type):
        return F.linear(x, weight, self.bias)
    return _SinkLinearFn.apply(x, weight, self.bias, sink)


_SWAP = ClassSwap(
    prefix="Sink",
    marker=_ORIGINAL_CLASS_ATTR,
    methods=lambda cls: {"forward": _sink_linear_forward},
    owner=__name__,
)


def class_swap(arg: object = None) -> ClassSwap:
    """The sink-linear class swap (what unpickling such a projection looks up)."""
    return _SWAP


def is_sink_linear(module: nn.Module | None) -> bool:
    return module is not None and _SWAP.applied(module)


def _plain_linear(module: object) -> bool:
    """A bare `nn.Linear` (not a subclass) with no hooks or forward of its own."""
    return type(module) is nn.Linear and "forward" not in module.__dict__ and plain_linear(module)


def enable_sink_linears(model: nn.Module) -> int:
    """Re-class every decoder layer's attention projections of `model` (see the module docstring).

    Returns the number of sink projections afterwards (calling it again changes nothing).
    Attention modules without the four plain `nn.Linear` projections are left alone, with one
    warning; `disable_sink_linears` undoes it.
    """
    layers = decoder_layers(model, "enable_sink_linears")
    chosen: list[nn.Module] = []
    skipped: set[str] = set()
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        projections = [getattr(attn, name, None) for name in PROJECTIONS]
        if all(is_sink_linear(p) or _plain_linear(p) for p in projections):
            chosen += projections  # type: ignore[arg-type]
        else:
            skipped.add(type(attn).__qualname__)
    warn_skipped(
        skipped,
        "enable_sink_linears left the attention of",
        f"its {'/'.join(PROJECTIONS)} are not all plain nn.Linear modules without hooks (LoRA or quantised "
        "layers compute their own gradients), so their weight gradients go through autograd",
    )
    return _SWAP.apply_all(chosen)


def disable_sink_linears(model: nn.Module) -> int:
    """Give every projection `enable_sink_linears` re-classed its original class back."""
    return len(_SWAP.undo(model))
