"""Attention projections that add their weight gradients straight into a `GradSink`.

The lean gated MLP hands its three weights' gradients to their sinks (`laden.model.patches.grad_sink`);
the attention layer's four projections (`q_proj`, `k_proj`, `v_proj`, `o_proj`) are plain
`nn.Linear`s, whose gradients autograd writes in bf16 for the roundpipe residency to add into
their fp32 accumulators: for Qwen3-1.7B that add is most of what is left of the fold, about
0.1 s of a 2 s step on an H200. `enable_sink_linears` re-classes those projections (a
`laden.model.patches.swap.ClassSwap`, so parameters, names and state dicts stay as they are) so that,
when the weight carries a sink and autograd records the call, the linear runs as one autograd
function whose backward gives the input's gradient as autograd's linear does and passes the
weight gradient's two factors to the sink, which adds their product into the accumulator in
one fp32-output GEMM on CUDA. Without a sink (any engine but roundpipe, or inside
`grad_sink.suspended()`), under autocast, or with an input in another dtype than the weight,
the projection is exactly `nn.Linear`.

Joint query, key and value: the attention layer calls `q_proj`, `k_proj` and `v_proj` on the
same input, three GEMMs forward and, in backward, three input-gradient GEMMs whose results
autograd adds up in two more passes over `[T, H]`. When their weights lie back to back in
one buffer (`laden.model.patches.stacked`: the roundpipe engine uploads a layer's parameters as one
flat buffer, in the module's order) and none has a bias, `enable_sink_linears` also makes the
attention module run them as one: a forward pre-hook computes the three outputs with one
GEMM (`_JointLinearFn`) and hands each projection its part, which the projection returns
when it is called on that very input. The backward sums the input gradient inside the GEMMs
(`addmm`: no separate adds) and gives each weight its gradient (or its sink the factors).
Anything else (weights apart, biases, autocast, a hooked projection, a compiled region)
runs the projections one by one, as before. Only for a model whose `enable_sink_linears` got
`PatchOptions(joint_projections=True)` (`laden.model.patches.options`; off by default, see
`laden.model.patches.stacked`): the hooks on its attention modules are that model's option, so
another model in the process keeps its own; calling `enable_sink_linears` again with the option
off removes them.

Only the roundpipe engine attaches sinks; under any other engine (fsdp, tensor parallel, one
device) these projections and the joint hooks are harmless but do nothing a plain `nn.Linear`
would not (FSDP2's gathered weights are separate tensors, never back to back).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from laden.model.patches.grad_sink import GradSink, sink_of
from laden.model.patches.options import EAGER, PatchOptions
from laden.model.patches.stacked import stacked_rows
from laden.model.patches.swap import ClassSwap, decoder_layers, hookless, plain_linear, warn_skipped

__all__ = ["disable_sink_linears", "enable_sink_linears", "is_sink_linear"]

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
JOINT = ("q_proj", "k_proj", "v_proj")  # the projections of one input
_ORIGINAL_CLASS_ATTR = "_laden_sink_linear_original_class"
_HANDED = "_laden_joint_output"  # on a projection: (input, its version, the output computed for it)


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


class _JointLinearFn(torch.autograd.Function):
    """`F.linear(x, w_i)` for every weight `w_i`, as one GEMM over their stacked rows.

    `apply(x, stacked, sinks, *weights)`: `stacked` is the weights' rows as one matrix (a view,
    `laden.model.patches.stacked.stacked_rows`), `sinks` their sinks (None: the gradient goes to autograd).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, stacked: torch.Tensor, sinks: tuple, *weights: torch.Tensor):
        ctx.save_for_backward(x, *weights)
        ctx.sinks = sinks
        return F.linear(x, stacked).split([w.shape[0] for w in weights], -1)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor):
        x, *weights = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[3:]
        rows = [g.reshape(-1, g.shape[-1]) for g in grads]
        grad_x = None
        if need_x:  # the sum over the projections inside the GEMMs, rounded once per addition
            acc = rows[0].mm(weights[0])
            for g, w in zip(rows[1:], weights[1:]):
                acc.addmm_(g, w)
            grad_x = acc.view(x.shape)
        x_rows = x.reshape(-1, x.shape[-1])
        grad_ws: list[torch.Tensor | None] = []
        for g, w, sink, need in zip(rows, weights, ctx.sinks, need_w):
            if need and sink is not None:
                sink.accumulate(g, x_rows, w.dtype)
            grad_ws.append(g.t().mm(x_rows) if need and sink is None else None)
        return grad_x, None, None, *grad_ws


def _joint_outputs(x: object, projections: list[Any]) -> tuple[torch.Tensor, ...] | None:
    """The projections' outputs for input `x` from one GEMM, or None where they must run one by one."""
    if not isinstance(x, torch.Tensor) or torch.compiler.is_compiling():
        return None
    if not all(is_sink_linear(p) and plain_sink_linear(p) and p.bias is None for p in projections):
        return None
    weights = [p.weight for p in projections]
    if x.dtype != weights[0].dtype or torch.is_autocast_enabled(x.device.type):
        return None
    stacked = stacked_rows(weights)
    if stacked is None:
        return None
    if not (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights))):
        return tuple(F.linear(x, stacked).split([w.shape[0] for w in weights], -1))
    sinks = tuple(sink_of(w) if w.requires_grad else None for w in weights)
    return _JointLinearFn.apply(x, stacked, sinks, *weights)


def _joint_pre_hook(attn: nn.Module, args: tuple, kwargs: dict) -> None:
    """Before the attention runs: its query, key and value projections of the input, in one GEMM."""
    x = kwargs["hidden_states"] if "hidden_states" in kwargs else (args[0] if args else None)
    projections = [attn._modules.get(name) for name in JOINT]
    outputs = _joint_outputs(x, projections)
    if outputs is not None:
        for projection, out in zip(projections, outputs):
            projection.__dict__[_HANDED] = (x, x._version, out)  # type: ignore[union-attr]


def _joint_post_hook(attn: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    """After the attention (also when it raised): no projection keeps an output it was not asked for."""
    for name in JOINT:
        projection = attn._modules.get(name)
        if projection is not None:
            projection.__dict__.pop(_HANDED, None)


def _has_joint_hooks(attn: nn.Module) -> bool:
    return any(hook is _joint_pre_hook for hook in attn._forward_pre_hooks.values())


def _add_joint_hooks(attn: nn.Module) -> None:
    if not _has_joint_hooks(attn):
        attn.register_forward_pre_hook(_joint_pre_hook, with_kwargs=True)
        attn.register_forward_hook(_joint_post_hook, with_kwargs=True, always_call=True)


def _remove_joint_hooks(attn: nn.Module) -> None:
    for hook_id, hook in list(attn._forward_pre_hooks.items()):
        if hook is _joint_pre_hook:
            del attn._forward_pre_hooks[hook_id]
            attn._forward_pre_hooks_with_kwargs.pop(hook_id, None)
    for hook_id, hook in list(attn._forward_hooks.items()):
        if hook is _joint_post_hook:
            del attn._forward_hooks[hook_id]
            attn._forward_hooks_with_kwargs.pop(hook_id, None)
            attn._forward_hooks_always_called.pop(hook_id, None)


def _sink_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    handed = self.__dict__.pop(_HANDED, None)
    if handed is not None and handed[0] is x and handed[1] == x._version:
        return handed[2]  # computed with its siblings by the attention's pre-hook
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


class_swap = _SWAP.lookup  # what unpickling such a projection looks up


def is_sink_linear(module: nn.Module | None) -> bool:
    return module is not None and _SWAP.applied(module)


def _plain_linear(module: object) -> bool:
    """A bare `nn.Linear` (not a subclass) with no hooks or forward of its own."""
    return type(module) is nn.Linear and "forward" not in module.__dict__ and plain_linear(module)


def plain_sink_linear(module: nn.Module) -> bool:
    """A sink projection without hooks or a forward of its own (its call is the sink forward)."""
    return "forward" not in module.__dict__ and hookless(module)


def enable_sink_linears(model: nn.Module, *, options: PatchOptions = EAGER) -> int:
    """Re-class every decoder layer's attention projections of `model` (see the module docstring);
    with `options.joint_projections` their attention modules also run query, key and value as one.

    Returns the number of sink projections afterwards (calling it again changes nothing but the
    joint projections, added or removed as `options` says). Attention modules without the four
    plain `nn.Linear` projections are left alone, with one warning; `disable_sink_linears` undoes it.
    """
    if not isinstance(options, PatchOptions):
        raise ValueError(f"options={options!r} must be a laden.model.patches.options.PatchOptions")
    layers = decoder_layers(model, "enable_sink_linears")
    chosen: list[nn.Module] = []
    attentions: list[nn.Module] = []
    skipped: set[str] = set()
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        projections = [getattr(attn, name, None) for name in PROJECTIONS]
        if all(is_sink_linear(p) or _plain_linear(p) for p in projections):
            chosen += projections  # type: ignore[arg-type]
            attentions.append(attn)  # type: ignore[arg-type]
        else:
            skipped.add(type(attn).__qualname__)
    warn_skipped(
        skipped,
        "enable_sink_linears left the attention of",
        f"its {'/'.join(PROJECTIONS)} are not all plain nn.Linear modules without hooks (LoRA or quantised "
        "layers compute their own gradients), so their weight gradients go through autograd",
    )
    for attn in attentions:
        if options.joint_projections:
            _add_joint_hooks(attn)
        else:
            _remove_joint_hooks(attn)
    return _SWAP.apply_all(chosen)


def disable_sink_linears(model: nn.Module) -> int:
    """Give every projection `enable_sink_linears` re-classed its original class back (and drop the
    attention hooks that run query, key and value as one)."""
    for module in model.modules():
        _remove_joint_hooks(module)
    return len(_SWAP.undo(model))
