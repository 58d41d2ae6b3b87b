"""Lean gated MLP: Hugging Face's SwiGLU feed-forward with a backward that keeps 2 of its 4 intermediates.

Hugging Face's Llama-style MLP (Qwen3, Qwen2, Llama, Mistral) computes
`down_proj(act_fn(gate_proj(x)) * up_proj(x))` in plain modules, so autograd keeps what
each op saves: `x` (for both projections), `g = gate_proj(x)` (for the activation),
`act(g)` and `u = up_proj(x)` (for the product), and `p = act(g) * u` (for `down_proj`):
H + 4I values per token, in the compute dtype. Under autocast each projection casts `x`
itself and keeps its own copy (2H + 4I), and every projection keeps its cast weight until
backward. For Qwen3-1.7B (H = 2048, I = 6144) in bf16 the MLP is 53,248 of the 117,416
bytes per token a decoder layer saves (see `laden.model.patches.lean_norm`).

`LeanGatedMLPFn` computes the same forward with the same ops (bitwise the same output, also
under autocast) but saves only `x` (cast once to the autocast dtype when autocast is on),
`g` and `u`: H + 2I values per token, 2I fewer (24,576 bytes per token for a bf16
Qwen3-1.7B layer: 117,416 -> 92,840, or 88,744 -> 64,168 with lean RMSNorms), and no cast
weights (backward casts them again). Backward recomputes `act(g) * u` (one elementwise pass
over [T, I], under the forward's autocast state, differentiated by autograd, so any
activation works: SiLU, GELU, ...) and does the three projections' gradients as plain
matmuls in the dtypes autograd uses: gradients in the compute dtype, weight (and bias)
gradients then cast to the parameter's dtype, the input gradient summed over both
projections in the input's dtype. fp32 gradients agree with Hugging Face's to float
rounding, bf16 ones to bf16 rounding. Frozen weights get no gradient (nor is it computed).
A weight with a `GradSink` (`laden.model.patches.grad_sink`, attached by an engine that sums
gradients in fp32 accumulators) gets none either: its gradient is added into the sink's
accumulator, in one fp32-output GEMM on CUDA.

With joint projections on (`PatchOptions.joint_projections`, off by default) and the gate and up
weights back to back without biases (the roundpipe upload), both projections are one
`[2I, H]` GEMM whose output halves are `gate` and `up`; the fused SwiGLU backward then writes
both gradients side by side, the input gradient is one GEMM over them, and sinks that can
join (`laden.model.patches.grad_sink.joint_sink`) take both weight gradients in one GEMM.

The tiled MLP (`laden.model.patches.tiled`) already keeps only `x` for the whole MLP; the two
compose in either order (`enable_lean_mlp` then `enable_tiled_mlp`, or the reverse): the
MLP runs tiled, its tiles lean, which lowers the intermediates a tile's backward holds. Such
an MLP copies (deep and shallow) but does not pickle: its tiled class's original is the
dynamic lean class, which pickle cannot find by name. Double backward is not supported. `g`
and `u` are saved before the activation runs, so an in-place activation fails loudly in
backward (autograd's version-counter error) instead of giving wrong gradients; none of
Hugging Face's is in place.

`enable_lean_mlp` swaps each decoder layer's `mlp` to a cached subclass of its class whose
only change is the lean `forward` (`laden.model.patches.swap`, as `laden.model.patches.lean_norm` swaps
RMSNorm classes): parameter names, state dicts and tied weights do not change, shallow copies
stay lean and run on their own weights, and `disable_lean_mlp` gives the original class back.
Eligible means: the class's `forward` compiles to the same code as Hugging Face's Llama-style
MLP forward (checked on the installed transformers), `gate_proj`, `up_proj` and `down_proj`
are plain `nn.Linear` (biases are supported, as `mlp_bias=True` gives) without hooks (the
lean forward calls `F.linear` on their weights and would bypass a hook or a subclass's own
forward, e.g. a LoRA or quantised layer), and `act_fn` is not in place. Other MLPs are left
alone with one warning. The check is repeated at every call: a projection hooked or
replaced after `enable_lean_mlp` (a LoRA adapter added later, tensor parallelism's DTensor
hooks) makes that MLP run its original forward, never bypassed. Each lean MLP keeps the model's
`PatchOptions` (`laden.model.patches.options`: fused SwiGLU kernels, joint gate/up projections)
in its `__dict__` and passes them to `LeanGatedMLPFn` at every call.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from laden.model.patches import fused, stacked
from laden.model.patches.grad_sink import GradSink, joint_sink, sink_of
from laden.model.patches.options import EAGER, PatchOptions, clear_options, options_of, set_options
from laden.model.patches.swap import (
    ClassSwap,
    check_own_forward,
    decoder_layers,
    plain_linear,
    same_code,
    warn_skipped,
)
from laden.model.patches.tiled import class_swap as tiled_swap

__all__ = ["LeanGatedMLPFn", "disable_lean_mlp", "enable_lean_mlp", "is_lean_mlp"]

_PLAIN_CLASS_ATTR = "_laden_plain_mlp_class"
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class LeanGatedMLPFn(torch.autograd.Function):
    """`F.linear(act_fn(x Wg^T + bg) * (x Wu^T + bu), Wd, bd)`, saving only `x`, gate and up.

    `LeanGatedMLPFn.apply(x, act_fn, w_gate, b_gate, w_up, b_up, w_down, b_down, options)`:
    `x` [..., H], `w_gate`, `w_up` [I, H], `w_down` [H, I], biases [I] / [H] or None, `act_fn`
    elementwise, `options` the model's `PatchOptions` (fused SwiGLU, joint gate/up projections).
    """

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        act_fn,
        w_gate: torch.Tensor,
        b_gate: torch.Tensor | None,
        w_up: torch.Tensor,
        b_up: torch.Tensor | None,
        w_down: torch.Tensor,
        b_down: torch.Tensor | None,
        options: PatchOptions,
    ) -> torch.Tensor:
        # Hugging Face's ops; `F.linear` casts `x` to the autocast dtype anyway, so casting it
        # once here changes no value and keeps one copy for both projections.
        x_in = _autocast_input(x)
        w_gate_up = _stacked(w_gate, b_gate, w_up, b_up, options)
        if w_gate_up is not None:  # one GEMM; gate and up are views of its output
            gate, up = F.linear(x_in, w_gate_up).split([w_gate.shape[0], w_up.shape[0]], -1)
        else:
            gate = F.linear(x_in, w_gate, b_gate)  # [..., I]
            up = F.linear(x_in, w_up, b_up)  # [..., I]
        ctx.save_for_backward(x_in, gate, up, w_gate, w_up, w_down)  # before act_fn could write to gate
        ctx.sinks = (sink_of(w_gate), sink_of(w_up), sink_of(w_down))  # an engine's fp32 accumulators
        ctx.act_fn, ctx.autocast, ctx.x_dtype = act_fn, _autocast_state(x.device.type), x.dtype
        ctx.options = options
        ctx.bias_dtypes = tuple(None if b is None else b.dtype for b in (b_gate, b_up, b_down))
        fusable = _fusable(act_fn, options)
        prod = fused.call(_swiglu, gate, up, options=options) if fusable else act_fn(gate) * up  # [..., I]
        out = F.linear(prod, w_down, b_down)  # [..., H]
        ctx.down_dtype = out.dtype  # the dtype down_proj computed in
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        x_in, gate, up, w_gate, w_up, w_down = ctx.saved_tensors
        need_x, _, need_wg, need_bg, need_wu, need_bu, need_wd, need_bd, _ = ctx.needs_input_grad
        need_gate, need_up = need_x or need_wg or need_bg, need_x or need_wu or need_bu
        gate = gate.detach().requires_grad_(need_gate)
        up = up.detach().requires_grad_(need_up)
        device_type = x_in.device.type
        enabled, dtype = ctx.autocast
        bias_gate_dtype, bias_up_dtype, bias_down_dtype = ctx.bias_dtypes
        options = ctx.options
        fused_swiglu = _fusable(ctx.act_fn, options)
        sink_gate, sink_up, sink_down = ctx.sinks
        w_gate_up = _stacked(w_gate, bias_gate_dtype, w_up, bias_up_dtype, options)
        grad_gate = grad_up = grad_gate_up = None
        if fused_swiglu:  # the product and both its input gradients in one compiled pass
            with _autocast(device_type, False, dtype):
                if need_gate or need_up:
                    grad_prod = (grad_out @ w_down.to(ctx.down_dtype)).to(gate.dtype)  # [..., I]
                    if w_gate_up is not None:  # both gradients in one [..., 2I] buffer, as gate and up were
                        prod, grad_gate_up = fused.call(
                            _swiglu_backward_stacked, gate.detach(), up.detach(), grad_prod, options=options
                        )
                        grad_gate, grad_up = grad_gate_up.split([gate.shape[-1], up.shape[-1]], -1)
                    else:
                        prod, grad_gate, grad_up = fused.call(
                            _swiglu_backward, gate.detach(), up.detach(), grad_prod, options=options
                        )
                    del grad_prod
                else:
                    prod = fused.call(_swiglu, gate, up, options=options)
        else:
            with torch.set_grad_enabled(need_gate or need_up), _autocast(device_type, enabled, dtype):
                prod = ctx.act_fn(gate) * up  # [..., I], recomputed: bitwise the forward's value
        # The gradients autograd's linear, cast and mul formulas give, in their dtypes, whatever
        # autocast state backward is called in.
        with _autocast(device_type, False, dtype):
            grad_w_down = grad_b_down = None
            if need_wd:
                grad_w_down = _weight_grad(
                    grad_out, prod.detach().to(ctx.down_dtype), w_down.dtype, sink_down
                )
            if need_bd:
                grad_b_down = _bias_grad(grad_out, bias_down_dtype)
            grad_x = grad_w_gate = grad_b_gate = grad_w_up = grad_b_up = None
            if need_gate or need_up:
                if not fused_swiglu:
                    grad_prod = (grad_out @ w_down.to(ctx.down_dtype)).to(prod.dtype)  # [..., I]
                    inputs = [t for t in (gate, up) if t.requires_grad]
                    grads = iter(torch.autograd.grad(prod, inputs, grad_prod))
                    del prod, grad_prod
                    grad_gate = next(grads) if need_gate else None  # [..., I], gate's dtype
                    grad_up = next(grads) if need_up else None
                joint = (
                    joint_sink((sink_gate, sink_up))
                    if grad_gate_up is not None and need_wg and need_wu
                    else None
                )
                if joint is not None:  # both weight gradients in one GEMM into stacked accumulators
                    assert grad_gate_up is not None
                    _weight_grad(grad_gate_up, x_in, w_gate.dtype, joint)
                else:
                    if grad_gate is not None and need_wg:
                        grad_w_gate = _weight_grad(grad_gate, x_in, w_gate.dtype, sink_gate)
                    if grad_up is not None and need_wu:
                        grad_w_up = _weight_grad(grad_up, x_in, w_up.dtype, sink_up)
                grad_b_gate = (
                    _bias_grad(grad_gate, bias_gate_dtype) if need_bg and grad_gate is not None else None
                )
                grad_b_up = _bias_grad(grad_up, bias_up_dtype) if need_bu and grad_up is not None else None
                if need_x:
                    assert grad_gate is not None and grad_up is not None
                    grad_x = _input_grad(
                        grad_gate, grad_up, grad_gate_up, w_gate, w_up, w_gate_up, ctx.x_dtype
                    )
        return grad_x, None, grad_w_gate, grad_b_gate, grad_w_up, grad_b_up, grad_w_down, grad_b_down, None


def _fusable(act_fn: object, options: PatchOptions) -> bool:
    """SiLU (the gated MLPs' activation) with fused kernels on: the compiled SwiGLU path."""
    return options.fused and (isinstance(act_fn, nn.SiLU) or type(act_fn).__name__ == "SiLUActivation")


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, in fp32, rounded once to gate's dtype (fused kernels only)."""
    g = gate.float()
    return (g * torch.sigmoid(g) * up.float()).to(gate.dtype)


def _swiglu_backward(
    gate: torch.Tensor, up: torch.Tensor, grad_prod: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(silu(gate) * up as `_swiglu` computes it, grad wrt gate, grad wrt up), from one pass over [..., I]."""
    g, u, gp = gate.float(), up.float(), grad_prod.float()
    sig = torch.sigmoid(g)
    silu = g * sig
    grad_gate = gp * u * (sig * (1 + g * (1 - sig)))  # d silu / d g = sig (1 + g (1 - sig))
    return (silu * u).to(gate.dtype), grad_gate.to(gate.dtype), (gp * silu).to(up.dtype)


def _swiglu_backward_stacked(
    gate: torch.Tensor, up: torch.Tensor, grad_prod: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_swiglu_backward` with the two input gradients written side by side: (product, [grad gate, grad up])."""
    prod, grad_gate, grad_up = _swiglu_backward(gate, up, grad_prod)
    return prod, torch.cat([grad_gate, grad_up], dim=-1)


def _stacked(
    w_gate: torch.Tensor, b_gate: object, w_up: torch.Tensor, b_up: object, options: PatchOptions
) -> torch.Tensor | None:
    """Gate and up weights as one `[2I, H]` matrix when joint projections are on
    (`laden.model.patches.stacked`), the weights lie back to back and have no biases."""
    if not options.joint_projections or b_gate is not None or b_up is not None:
        return None
    return stacked.stacked_rows((w_gate, w_up))


def _input_grad(
    grad_gate: torch.Tensor,
    grad_up: torch.Tensor,
    grad_gate_up: torch.Tensor | None,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_gate_up: torch.Tensor | None,
    x_dtype: torch.dtype,
) -> torch.Tensor:
    """The gradient of `x` through both projections, in `x_dtype`: one GEMM over the stacked
    gradients and weights (their sum rounded once); else autograd's two products, each cast,
    then summed."""
    dtype = grad_gate.dtype
    if grad_gate_up is not None and w_gate_up is not None:
        return (grad_gate_up @ w_gate_up.to(dtype)).to(x_dtype)
    grad_x = (grad_gate @ w_gate.to(dtype)).to(x_dtype)  # one gradient per projection, then summed
    grad_x += (grad_up @ w_up.to(grad_up.dtype)).to(x_dtype)
    return grad_x


def _weight_grad(
    grad: torch.Tensor, inp: torch.Tensor, dtype: torch.dtype, sink: GradSink | None
) -> torch.Tensor | None:
    """grad [..., n_out]^T @ inp [..., n_in] over all rows: [n_out, n_in], cast to the weight's dtype;
    or, given the weight's sink, added into the sink's accumulator (no gradient is returned then)."""
    grad, inp = grad.reshape(-1, grad.shape[-1]), inp.reshape(-1, inp.shape[-1])
    if sink is not None:
        sink.accumulate(grad, inp, dtype)
        return None
    return grad.t().mm(inp).to(dtype)


def _bias_grad(grad: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    assert dtype is not None, "a bias that needs a gradient has a dtype"
    return grad.reshape(-1, grad.shape[-1]).sum(0).to(dtype)


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype | None]:
    if not torch.amp.is_autocast_available(device_type):
        return False, None  # a device without autocast (meta, ...)
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _autocast(
    device_type: str, enabled: bool, dtype: torch.dtype | None
) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype, enabled=enabled)


def _autocast_input(x: torch.Tensor) -> torch.Tensor:
    """`x` as autocast hands it to a linear: cast to the autocast dtype if autocast is on and `x` eligible."""
    enabled, dtype = _autocast_state(x.device.type)
    if enabled and dtype is not None and x.is_floating_point() and x.dtype != torch.float64:
        return x.to(dtype)
    return x


# The statements of Hugging Face's Llama-style MLP.forward (names included): an MLP is made lean only
# if its forward compiles to this same code. No docstring: it would be a code constant.
def _hf_mlp_forward(self, x):
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


def _lean_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The lean class's `forward`: the original's result, saving only `x`, gate and up.

    A projection replaced or hooked after the MLP was made lean (a LoRA adapter added later,
    a forward hook) would be bypassed by reading its weight directly; such an MLP runs its
    original forward instead.
    """
    gate, up, down = self.gate_proj, self.up_proj, self.down_proj
    if not (plain_linear(gate) and plain_linear(up) and plain_linear(down)):
        plain = next(
            c.__dict__[_PLAIN_CLASS_ATTR] for c in type(self).__mro__ if _PLAIN_CLASS_ATTR in c.__dict__
        )
        return plain.forward(self, x)  # (tiled, the lean class is a base: look it up in the MRO)
    return LeanGatedMLPFn.apply(
        x, self.act_fn, gate.weight, gate.bias, up.weight, up.bias, down.weight, down.bias, options_of(self)
    )


_SWAP = ClassSwap(
    prefix="Lean",
    marker=_PLAIN_CLASS_ATTR,
    methods=lambda cls: {"forward": _lean_mlp_forward},
    owner=__name__,
)


class_swap = _SWAP.lookup  # what unpickling a lean MLP looks up


def is_lean_mlp(module: nn.Module | None) -> bool:
    """Whether `module` runs the lean forward: made lean by `enable_lean_mlp`, tiled or not."""
    if module is None:
        return False
    tiled = tiled_swap()
    cls = tiled.original(module) if tiled.applied(module) else type(module)
    return _PLAIN_CLASS_ATTR in cls.__dict__


def _lean_class(module: nn.Module) -> type[nn.Module] | None:
    """The class that makes `module` lean (tiled stays tiled), or None if it is not Hugging Face's MLP."""
    tiled = tiled_swap()
    plain = tiled.original(module) if tiled.applied(module) else type(module)
    act_fn = getattr(module, "act_fn", None)
    eligible = (
        same_code(plain.forward, _hf_mlp_forward)
        and all(plain_linear(getattr(module, name, None)) for name in _PROJECTIONS)
        and callable(act_fn)
        and not getattr(act_fn, "inplace", False)
    )
    if not eligible:
        return None
    lean = _SWAP.subclass(plain)
    return tiled.subclass(lean) if tiled.applied(module) else lean


def enable_lean_mlp(model: nn.Module, *, options: PatchOptions = EAGER) -> int:
    """Make every decoder layer's Hugging Face Llama-style `mlp` in `model` lean (see the module
    docstring), running with `options` (fused SwiGLU kernels, joint gate/up projections).

    Returns the number of lean MLPs in the decoder layers afterwards (calling it again changes
    nothing but the options, which every lean MLP of `model` then runs with). A tiled MLP (`laden.model.patches.tiled`) stays tiled and runs lean tiles. MLPs of other
    kinds are left alone, with one warning. Parameters, their names and the state dict are
    untouched; `disable_lean_mlp` undoes it.
    """
    layers = decoder_layers(
        model,
        "enable_lean_mlp",
        "; for other modules call laden.model.patches.lean_mlp.LeanGatedMLPFn.apply directly",
    )
    lean: list[tuple[nn.Module, type[nn.Module] | None]] = []
    skipped = set()
    for index, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module):
            skipped.add(f"{type(layer).__qualname__} without an `mlp`")
        elif is_lean_mlp(mlp):
            lean.append((mlp, None))
        elif (cls := _lean_class(mlp)) is None:
            skipped.add(type(mlp).__qualname__)
        else:
            check_own_forward(mlp, f"{type(model).__name__}: layers.{index}.mlp", "the lean MLP")
            lean.append((mlp, cls))
    warn_skipped(
        skipped,
        "enable_lean_mlp left",
        "not Hugging Face's Llama-style gated MLP down_proj(act_fn(gate_proj(x)) * up_proj(x)) with plain "
        "nn.Linear projections (no hooks, no LoRA or quantised layers) and an out-of-place act_fn, so it "
        "keeps its own backward",
    )
    for mlp, cls in lean:  # all checked before any is switched
        set_options(mlp, options)
        if cls is not None:
            mlp.__class__ = cls
    return len(lean)


def disable_lean_mlp(model: nn.Module) -> int:
    """Give every MLP `enable_lean_mlp` made lean its original class back (tiled ones stay tiled).

    Returns how many.
    """
    tiled = tiled_swap()
    undone = 0
    for module in model.modules():
        if _SWAP.applied(module):
            module.__class__ = _SWAP.original(module)
        elif tiled.applied(module) and is_lean_mlp(module):
            module.__class__ = tiled.subclass(tiled.original(module).__dict__[_PLAIN_CLASS_ATTR])
        else:
            continue
        clear_options(module)
        undone += 1
    return undone
