"""Rotary position embedding as one fused forward and one fused backward (`actor.fused_elementwise`).

Hugging Face's attention layers (Qwen3, Qwen2, Llama, Mistral) rotate queries and keys with
their module's `apply_rotary_pos_emb(q, k, cos, sin)`: `q * cos + rotate_half(q) * sin`, where
`rotate_half` slices, negates and concatenates. That is five kernels per tensor in forward
and about seven in backward (slice backwards allocate zeros and copy), each a full pass
over the queries or keys. At one or two 4096-token sequences per micro-batch on an H200 the
training step waits for the thread that launches kernels, and these are about 25 of a
decoder layer's launches per micro-batch (`benchmarks/RESULTS.md`).

`enable_fused_rotary(model, options=...)` re-classes each decoder layer's `self_attn` (as
`laden.model.patches.swap` does for the lean modules) to a subclass whose `forward` is the
original `forward`'s own code, with only its global name `apply_rotary_pos_emb` bound to a
function that, with `options.fused` (`laden.model.patches.options`), runs `RotaryFn`: the
rotation of both tensors in one compiled function and its backward in another, the arithmetic
in fp32 and rounded once (so equal to the eager ops to float rounding, like the other fused
kernels). With fused kernels off, or for inputs it does not take (tensor subclasses, cos/sin
that need gradients), it calls the module's original function: bitwise Hugging Face's result.
The rotation is called without its module, so the options live in the class: one subclass
per original class and `PatchOptions` (`class_swap(options)`), and two models with different
options each run their own.

A class is re-classed only if its `forward` looks up the global `apply_rotary_pos_emb` and
that function computes the standard rotation (checked numerically once per class, in float64
on the CPU); others are left alone, with one warning. Decorators on `forward` that wrap it
with `functools.wraps` (transformers' `deprecate_kwarg`) are kept: each layer is rebuilt
around the rebound function. `disable_fused_rotary` gives the original classes back.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from laden.model.patches import fused
from laden.model.patches.options import PatchOptions
from laden.model.patches.swap import ClassSwap, check_own_forward, decoder_layers, warn_skipped

__all__ = ["RotaryFn", "disable_fused_rotary", "enable_fused_rotary", "is_fused_rotary", "rotary_options"]

_NAME = "apply_rotary_pos_emb"
_ORIGINAL_CLASS_ATTR = "_laden_unfused_rotary_class"
FUSED = PatchOptions(fused=True)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(q, k, cos, sin, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q cos + rotate_half(q) sin, the same for k), in fp32, each rounded once to its input's dtype."""
    cos, sin = cos.unsqueeze(dim).float(), sin.unsqueeze(dim).float()
    qf, kf = q.float(), k.float()
    return (qf * cos + _rotate_half(qf) * sin).to(q.dtype), (kf * cos + _rotate_half(kf) * sin).to(k.dtype)


def _rope_backward(grad_q, grad_k, cos, sin, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The input gradients: rotate_half's adjoint is -rotate_half, so dx = g cos - rotate_half(g sin)."""
    cos, sin = cos.unsqueeze(dim).float(), sin.unsqueeze(dim).float()
    gq, gk = grad_q.float(), grad_k.float()
    return (
        (gq * cos - _rotate_half(gq * sin)).to(grad_q.dtype),
        (gk * cos - _rotate_half(gk * sin)).to(grad_k.dtype),
    )


class RotaryFn(torch.autograd.Function):
    """`RotaryFn.apply(q, k, cos, sin, unsqueeze_dim, options)`: Hugging Face's `apply_rotary_pos_emb`,
    compiled with `options` (`PatchOptions`).

    cos and sin get no gradient (they come from the rotary embedding's buffers)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim: int, options: PatchOptions):
        ctx.save_for_backward(cos, sin)
        ctx.dim, ctx.options = unsqueeze_dim, options
        return fused.call(_rope, q, k, cos, sin, unsqueeze_dim, options=options)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        dq, dk = fused.call(_rope_backward, grad_q, grad_k, cos, sin, ctx.dim, options=ctx.options)
        return dq, dk, None, None, None, None


def _rotary_for(original: Callable, options: PatchOptions) -> Callable:
    """What the rebound `forward` of a class with `options` calls by the name `apply_rotary_pos_emb`."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if (
            options.fused
            and all(type(t) is torch.Tensor for t in (q, k, cos, sin))
            and not (cos.requires_grad or sin.requires_grad)
        ):
            return RotaryFn.apply(q, k, cos, sin, unsqueeze_dim, options)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.__wrapped__ = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


class _NotRebindable(Exception):
    pass


def _rebound(fn: Callable, replacement: Callable) -> types.FunctionType:
    """`fn` with its global `apply_rotary_pos_emb` bound to `replacement`; a `functools.wraps` wrapper
    is rebuilt around the rebound function it wraps (its closure cell swapped), layer by layer."""
    if not isinstance(fn, types.FunctionType):
        raise _NotRebindable(f"{fn!r} is not a Python function")
    inner = getattr(fn, "__wrapped__", None)
    if inner is not None:
        cells = fn.__closure__ or ()
        holds_inner = [_cell_holds(cell, inner) for cell in cells]
        if not any(holds_inner):
            raise _NotRebindable(f"{fn.__qualname__} wraps {inner!r} without holding it in its closure")
        new_inner = _rebound(inner, replacement)
        closure = tuple(types.CellType(new_inner) if held else cell for cell, held in zip(cells, holds_inner))
        new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, closure)
        new.__wrapped__ = new_inner  # type: ignore[attr-defined]
    else:
        if _NAME not in fn.__code__.co_names:
            raise _NotRebindable(f"{fn.__qualname__} does not call a global {_NAME}")
        scope = {**fn.__globals__, _NAME: replacement}
        new = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__, new.__doc__, new.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    new.__dict__.update({k: v for k, v in fn.__dict__.items() if k != "__wrapped__"})
    return new


def _cell_holds(cell: types.CellType, obj: object) -> bool:
    try:
        return cell.cell_contents is obj
    except ValueError:  # an empty cell
        return False


@functools.cache
def _standard_rotation(fn: Callable) -> bool:
    """Whether `fn(q, k, cos, sin)` is the standard rotation (float64, CPU, small random inputs)."""
    gen = torch.Generator().manual_seed(0)
    q, k = (
        torch.randn(1, 2, 3, 4, generator=gen, dtype=torch.float64),
        torch.randn(1, 1, 3, 4, generator=gen, dtype=torch.float64),
    )
    cos, sin = (
        torch.randn(1, 3, 4, generator=gen, dtype=torch.float64),
        torch.randn(1, 3, 4, generator=gen, dtype=torch.float64),
    )
    try:
        got = fn(q, k, cos, sin)
    except Exception:  # a different signature or rotation: not what this module replaces
        return False
    want = _rope(q, k, cos, sin, 1)
    return (
        isinstance(got, tuple)
        and len(got) == 2
        and all(
            isinstance(g, torch.Tensor) and g.shape == w.shape and torch.allclose(g, w)
            for g, w in zip(got, want)
        )
    )


def _methods(options: PatchOptions) -> Callable[[type[nn.Module]], dict[str, Any]]:
    def methods(cls: type[nn.Module]) -> dict[str, Any]:
        forward = cls.forward
        original = inspect.unwrap(forward).__globals__[_NAME]
        return {"forward": _rebound(forward, _rotary_for(original, options))}

    return methods


_SWAPS: dict[PatchOptions, ClassSwap] = {}  # a cache of classes, one family per options value


def class_swap(options: PatchOptions) -> ClassSwap:
    """The class swap whose subclasses rotate with `options` (all share one marker); what unpickling
    such an attention module looks up."""
    if options not in _SWAPS:
        _SWAPS[options] = ClassSwap(
            prefix="FusedRope", marker=_ORIGINAL_CLASS_ATTR, methods=_methods(options), owner=__name__,
            arg=options,
        )  # fmt: skip
    return _SWAPS[options]


def is_fused_rotary(module: nn.Module | None) -> bool:
    return module is not None and _ORIGINAL_CLASS_ATTR in type(module).__dict__


def rotary_options(module: nn.Module | None) -> PatchOptions | None:
    """The options an attention module re-classed by `enable_fused_rotary` rotates with; else None."""
    if not is_fused_rotary(module):
        return None
    return type(module)._laden_swap.arg  # type: ignore[union-attr]


def _eligible(cls: type[nn.Module]) -> bool:
    forward = getattr(cls, "forward", None)
    if not isinstance(forward, types.FunctionType):
        return False
    inner = inspect.unwrap(forward)
    rotation = getattr(inner, "__globals__", {}).get(_NAME)
    if rotation is None or _NAME not in inner.__code__.co_names or not _standard_rotation(rotation):
        return False
    try:
        _rebound(forward, rotation)
    except _NotRebindable:
        return False
    return True


def enable_fused_rotary(model: nn.Module, *, options: PatchOptions = FUSED) -> int:
    """Re-class every decoder layer's `self_attn` of `model` as described in the module docstring,
    rotating with `options` (the default: fused kernels, static last dimensions).

    Returns the number of attention modules with the fused rotation afterwards (calling it again
    changes nothing but the options, which every such module of `model` then rotates with).
    Other attention modules are left alone, with one warning. Parameters, their names and the
    state dict are untouched; `disable_fused_rotary` undoes it.
    """
    if not isinstance(options, PatchOptions):
        raise ValueError(f"options={options!r} must be a laden.model.patches.options.PatchOptions")
    layers = decoder_layers(model, "enable_fused_rotary")
    chosen: list[nn.Module] = []
    skipped = set()
    for index, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if not isinstance(attn, nn.Module):
            skipped.add(f"{type(layer).__qualname__} without a `self_attn`")
        elif is_fused_rotary(attn) or _eligible(type(attn)):
            check_own_forward(attn, f"{type(model).__name__}: layers.{index}.self_attn", "the fused rotation")
            chosen.append(attn)
        else:
            skipped.add(type(attn).__qualname__)
    warn_skipped(
        skipped,
        "enable_fused_rotary left",
        f"its forward does not call a module-level {_NAME}(q, k, cos, sin) computing q * cos + rotate_half(q) * sin",
    )
    swap = class_swap(options)
    for attn in chosen:  # all checked before any is switched
        original = type(attn).__dict__[_ORIGINAL_CLASS_ATTR] if is_fused_rotary(attn) else type(attn)
        attn.__class__ = swap.subclass(original)
    return len(chosen)


def disable_fused_rotary(model: nn.Module) -> int:
    """Give every attention module `enable_fused_rotary` re-classed its original class back."""
    return len(class_swap(FUSED).undo(model))  # undo reads only the shared marker
