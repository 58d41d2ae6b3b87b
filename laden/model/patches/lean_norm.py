"""Lean RMSNorm: Hugging Face's RMSNorm with a backward that keeps the input, not fp32 copies.

Hugging Face's Llama-style RMSNorm (Qwen3, Qwen2, Llama, Mistral: about 140 classes)
computes `weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)` in plain ops,
so autograd keeps what those ops save: the fp32 copy of `x` (for `pow` and the `mul` by
the reciprocal RMS) and the normalised value cast back to `x.dtype` (for the weight
gradient). For a bf16 input of width W that is 4W + 2W bytes per row where `x` itself is
2W. Measured on one Qwen3-1.7B decoder layer in bf16 (hidden 2048, 16 heads, 8 KV heads,
head_dim 128, T = 2048, varlen attention): 117,416 bytes per token saved for backward, or
68,264 with the MLP tiled (`laden.model.patches.tiled`); its four norms (input_layernorm and
post_attention_layernorm of W = 2048, q_norm 16 x 128, k_norm 8 x 128) keep 43,112 of them.

`LeanRMSNormFn` computes the same forward with the same ops (bitwise the same output) but
saves only `x` in its own dtype and the fp32 reciprocal RMS per row (`[..., 1]`, which
Hugging Face's graph keeps too), and recomputes the normalised value in backward. A bf16
norm then saves 2W instead of 6W bytes per row, 4W fewer: 8 KiB per token for each
W = 2048 norm, 28 KiB (28,672 bytes) per Qwen3-1.7B layer: 117,416 -> 88,744 bytes per
token, and 68,264 -> 39,592 (-42%) with the MLP tiled. In fp32 it saves `x` where Hugging
Face saves `x` and the normalised value (4W fewer). Backward replays autograd's own
formulas and dtype casts (the gradient of the normalised value is rounded to `x.dtype` as
Hugging Face's graph rounds it; the weight gradient is `sum_to_size` in the output dtype,
then cast to the weight's dtype), so fp32 gradients agree to float rounding and bf16 ones
to bf16 rounding.

Cost: backward recomputes `x.float() * rstd` (one elementwise pass over the row, far less
than the matmuls around it). The input is saved by reference, not copied: an in-place write
to it after the norm makes backward raise autograd's version-counter error (Hugging Face's
graph holds an fp32 copy of a bf16 input and would not); no Hugging Face decoder layer
writes to a norm's input. Double backward is not supported.

`enable_lean_rmsnorm(model, options=...)` swaps each eligible module's class to a cached
subclass whose only change is the lean `forward` (`laden.model.patches.swap`, as `laden.model.patches.tiled` swaps MLP classes):
parameter names, state dicts and tied weights do not change, shallow copies stay lean and
run on their own weight, and `disable_lean_rmsnorm` gives the original class back. Eligible means:
the class name ends with `RMSNorm`, the module has a 1-D `weight` tensor and a
`variance_epsilon`, and the class's `forward` compiles to the same code as Hugging Face's
Llama-style forward (checked on the installed transformers, so a family that changes its
norm is left alone). Gemma's `x * (1 + weight)` computed in fp32, Olmo2's
`(weight * x).to(dtype)` and other variants differ and are skipped with a warning. Each lean
norm keeps the model's `PatchOptions` (`laden.model.patches.options`: fused kernels or eager
ops) in its `__dict__` and passes them to `LeanRMSNormFn` at every call.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from laden.model.patches import fused
from laden.model.patches.options import EAGER, PatchOptions, clear_options, options_of, set_options
from laden.model.patches.swap import ClassSwap, check_own_forward, same_code, warn_skipped

__all__ = [
    "LeanRMSNormFn",
    "disable_lean_rmsnorm",
    "enable_lean_rmsnorm",
    "lean_rms_norm",
]

_PLAIN_CLASS_ATTR = "_laden_plain_norm_class"


class LeanRMSNormFn(torch.autograd.Function):
    """Hugging Face's RMSNorm, `weight * normed(x).to(x.dtype)`, saving only `x` and `rstd`.

    `LeanRMSNormFn.apply(x, weight, eps, options)`: `x` [..., W] of any float dtype, `weight` [W],
    `options` the model's `PatchOptions` (fused kernels or eager ops). Output dtype is
    `torch.result_type(weight, x)`, as in Hugging Face's forward.
    """

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, options: PatchOptions
    ) -> torch.Tensor:
        out, rstd = fused.call(_norm_forward, x, weight, eps, options=options)
        ctx.save_for_backward(x, weight, rstd)
        ctx.options = options
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        need_x, need_weight = ctx.needs_input_grad[:2]
        # Autograd's formulas for Hugging Face's graph, in fp32 whatever autocast is active
        # (a backward called inside an autocast region must not change their dtypes).
        with _autocast_off(x.device.type):
            grad_x, grad_weight = fused.call(
                _norm_backward, grad_out, x, weight, rstd, need_x, need_weight, options=ctx.options
            )
        return grad_x, grad_weight, None, None


def _norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, rstd [..., 1] fp32): the very ops of Hugging Face's forward, so bitwise its output."""
    x_f32 = x.to(torch.float32)
    variance = x_f32.pow(2).mean(-1, keepdim=True)  # [..., 1]
    rstd = torch.rsqrt(variance + eps)  # [..., 1] fp32
    return weight * (x_f32 * rstd).to(x.dtype), rstd


def _norm_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    need_x: bool,
    need_weight: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(grad wrt x, grad wrt weight), None where not needed."""
    x_f32 = x.to(torch.float32)  # [..., W]
    grad_weight = None
    if need_weight:
        normed = (x_f32 * rstd).to(x.dtype)  # recomputed: bitwise the forward's value
        grad_weight = (grad_out * normed).sum_to_size(weight.shape).to(weight.dtype)
    grad_x = _input_grad(grad_out, x_f32, weight, rstd, x.dtype) if need_x else None
    return grad_x, grad_weight


def _input_grad(
    grad_out: torch.Tensor,
    x_f32: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    input_dtype: torch.dtype,
) -> torch.Tensor:
    """d(loss)/dx through `x.float() -> * rstd -> .to(dtype) -> weight *`, as autograd computes it."""
    # d/d normed, rounded to the input dtype as autograd rounds it there, then back to fp32.
    grad_normed = (grad_out * weight).to(input_dtype).to(torch.float32)  # [..., W], a fresh tensor
    grad_rstd = (grad_normed * x_f32).sum(-1, keepdim=True)  # [..., 1]
    grad_variance = -0.5 * grad_rstd * rstd.pow(3)  # rsqrt's backward
    # mean's backward divides by W; pow(2)'s multiplies by 2 * x (the doubling is exact).
    scale = grad_variance / x_f32.shape[-1] * 2  # [..., 1]
    grad_x_f32 = grad_normed.mul_(rstd).add_(x_f32 * scale)  # [..., W]
    return grad_x_f32.to(input_dtype)


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()  # a device without autocast (meta, ...): nothing to turn off


def lean_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, options: PatchOptions = EAGER
) -> torch.Tensor:
    """Hugging Face's Llama-style RMSNorm of `x` [..., W] with weight [W], saving `x` and `rstd` only."""
    return LeanRMSNormFn.apply(x, weight, eps, options)


# The statements of Hugging Face's Llama-style RMSNorm.forward (names included): a class is made lean
# only if its forward compiles to this same code. No docstring: it would be a code constant.
def _hf_rmsnorm_forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


def _lean_rmsnorm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The lean class's `forward`: the original's result, saving only the input and `rstd`."""
    return LeanRMSNormFn.apply(hidden_states, self.weight, self.variance_epsilon, options_of(self))


_SWAP = ClassSwap(
    prefix="Lean",
    marker=_PLAIN_CLASS_ATTR,
    methods=lambda cls: {"forward": _lean_rmsnorm_forward},
    owner=__name__,
)


class_swap = _SWAP.lookup  # what unpickling a lean norm looks up


def _is_hf_rmsnorm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and isinstance(getattr(module, "variance_epsilon", None), float | int)
        and same_code(type(module).forward, _hf_rmsnorm_forward)
    )


def enable_lean_rmsnorm(model: nn.Module, *, options: PatchOptions = EAGER) -> int:
    """Make every Hugging Face Llama-style RMSNorm in `model` lean (see the module docstring),
    running with `options` (fused kernels or eager ops).

    Returns the number of lean norms in `model` afterwards (calling it again changes nothing but
    the options, which every lean norm of `model` then runs with). Modules named `...RMSNorm`
    with other semantics are left alone, with one warning. Parameters, their names and the state
    dict are untouched; `disable_lean_rmsnorm` undoes it.
    """
    norms, skipped = [], set()
    for name, module in model.named_modules():
        if _SWAP.applied(module):
            norms.append(module)
        elif type(module).__name__.endswith("RMSNorm"):
            if not _is_hf_rmsnorm(module):
                skipped.add(type(module).__qualname__)
                continue
            check_own_forward(module, f"{type(model).__name__}: {name}", "the lean norm")
            norms.append(module)
    warn_skipped(
        skipped,
        "enable_lean_rmsnorm left",
        "its forward is not Hugging Face's Llama-style RMSNorm (weight * normed(x).to(x.dtype)), so it "
        "keeps its own backward",
    )
    for norm in norms:  # all checked before any is switched
        set_options(norm, options)
    return _SWAP.apply_all(norms)


def disable_lean_rmsnorm(model: nn.Module) -> int:
    """Give every norm `enable_lean_rmsnorm` switched its original class back; returns how many."""
    undone = _SWAP.undo(model)
    for norm in undone:
        clear_options(norm)
    return len(undone)
