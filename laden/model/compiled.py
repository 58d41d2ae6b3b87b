"""Compiled decoder layers: each layer's forward through `torch.compile`, one compiled code for all.

Profiled on one H200 (Qwen3-1.7B shape, roundpipe engine, `benchmarks/RESULTS.md`): kernels
keep the GPU 91% busy, and of their time the unfused elementwise, cast and reduction kernels
of the Hugging Face layer (RMSNorm in fp32, rotary, SiLU x up, residual adds, casts) take a
large share next to the GEMMs and flash attention. `torch.compile` fuses those into a few
generated kernels.

`enable_compiled_layers` swaps each decoder layer's class to a cached subclass whose
`forward` runs the original class's `forward` through one `torch.compile`d function per
original class (the way `laden.model.tiled` swaps MLP classes): parameter names and state
dicts do not change, and the shallow copies the roundpipe engine binds to device weights
stay compiled. The compiled function takes the layer as an argument; Dynamo treats its
parameters as inputs, so the layers of a model (and every copy of them) share the same
compiled code instead of compiling once per layer. Attention over packed sequences reads
`cu_seqlens` and graph-breaks there: attention runs eagerly (its kernel is already fused),
the token-wise work before and after it is compiled. Sequence lengths that change from call
to call are made dynamic after the first change (`torch.compile`'s default), so packed
micro-batches of varying length do not recompile each time.

Costs: the first call of each shape compiles (tens of seconds with `inductor`), and compiled
code is not bitwise the eager result (fused kernels round differently). `disable_compiled_layers`
gives the original classes back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["compiled_layer_count", "disable_compiled_layers", "enable_compiled_layers"]

_EAGER_CLASS_ATTR = "_laden_eager_layer_class"
_COMPILED: dict[tuple[type, str], type] = {}


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a Hugging Face causal LM (`model.model.layers` or `model.layers`)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"{type(model).__name__} has no decoder layers at .model.layers or .layers; compiled layers "
            "need a Hugging Face causal LM (Qwen3, Qwen2, Llama, Mistral, ...)"
        )
    return list(layers)


def _compiled_class(cls: type[nn.Module], backend: str) -> type:
    key = (cls, backend)
    if key not in _COMPILED:
        compiled: Callable[..., Any] = torch.compile(cls.forward, backend=backend)

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return compiled(self, *args, **kwargs)

        _COMPILED[key] = type(
            f"Compiled{cls.__name__}",
            (cls,),
            {"forward": forward, _EAGER_CLASS_ATTR: cls, "__module__": __name__},
        )
    return _COMPILED[key]


def _is_compiled(module: nn.Module) -> bool:
    return _EAGER_CLASS_ATTR in type(module).__dict__


def enable_compiled_layers(model: nn.Module, *, backend: str = "inductor") -> int:
    """Run every decoder layer of `model` through `torch.compile(backend=backend)`; returns how many.

    Calling it again changes nothing (layers already compiled keep their backend).
    """
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend={backend!r} must name a torch.compile backend, e.g. 'inductor'")
    layers = _decoder_layers(model)
    for layer in layers:
        if "forward" in layer.__dict__:
            raise ValueError(
                f"{type(layer).__name__} has its forward replaced on the instance (e.g. by accelerate's "
                "device_map hooks), which would bypass compilation; load the model without a device_map"
            )
    for layer in layers:
        if not _is_compiled(layer):
            layer.__class__ = _compiled_class(type(layer), backend)
    return len(layers)


def compiled_layer_count(model: nn.Module) -> int:
    """How many modules of `model` run through a compiled layer class."""
    return sum(_is_compiled(m) for m in model.modules())


def disable_compiled_layers(model: nn.Module) -> int:
    """Give every compiled layer its original class back; returns how many."""
    count = 0
    for module in model.modules():
        if _is_compiled(module):
            module.__class__ = type(module).__dict__[_EAGER_CLASS_ATTR]
            count += 1
    return count
