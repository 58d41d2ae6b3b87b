"""Compiled decoder layers: each layer's forward through `torch.compile`, one compiled code for all.

Profiled on one H200 (Qwen3-1.7B shape, roundpipe engine, `benchmarks/RESULTS.md`): kernels
keep the GPU 91% busy, and of their time the unfused elementwise, cast and reduction kernels
of the Hugging Face layer (RMSNorm in fp32, rotary, SiLU x up, residual adds, casts) take a
large share next to the GEMMs and flash attention. `torch.compile` fuses those into a few
generated kernels.

`enable_compiled_layers` swaps each decoder layer's class to a cached subclass whose
`forward` runs the original class's `forward` through one `torch.compile`d function per
original class and backend (`laden.model.patches.swap`, as `laden.model.patches.tiled` swaps MLP
classes): parameter names and state dicts do not change, the shallow copies the roundpipe
engine binds to device weights stay compiled, and a pickled model unpickles compiled. The compiled function takes the layer as an argument; Dynamo treats its
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

from laden.model.patches.swap import ClassSwap, check_own_forward, decoder_layers

__all__ = ["compiled_layer_count", "disable_compiled_layers", "enable_compiled_layers"]

_EAGER_CLASS_ATTR = "_laden_eager_layer_class"
_SWAPS: dict[str, ClassSwap] = {}


def _compiled_methods(backend: str) -> Callable[[type[nn.Module]], dict[str, Any]]:
    def methods(cls: type[nn.Module]) -> dict[str, Any]:
        compiled: Callable[..., Any] = torch.compile(cls.forward, backend=backend)

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return compiled(self, *args, **kwargs)

        return {"forward": forward}

    return methods


def class_swap(backend: str) -> ClassSwap:
    """The compiled-layer class swap of one `torch.compile` backend (all share one marker)."""
    if backend not in _SWAPS:
        _SWAPS[backend] = ClassSwap(
            prefix="Compiled", marker=_EAGER_CLASS_ATTR, methods=_compiled_methods(backend), owner=__name__,
            arg=backend,
        )  # fmt: skip
    return _SWAPS[backend]


def enable_compiled_layers(model: nn.Module, *, backend: str = "inductor") -> int:
    """Run every decoder layer of `model` through `torch.compile(backend=backend)`; returns how many.

    Calling it again changes nothing (layers already compiled keep their backend).
    """
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend={backend!r} must name a torch.compile backend, e.g. 'inductor'")
    layers = decoder_layers(model, "enable_compiled_layers")
    for index, layer in enumerate(layers):
        check_own_forward(layer, f"{type(model).__name__}: layers.{index}", "compilation")
    swap = class_swap(backend)
    for layer in layers:
        swap.apply(layer)  # a layer compiled with another backend keeps it: the marker is shared
    return len(layers)


def compiled_layer_count(model: nn.Module) -> int:
    """How many modules of `model` run through a compiled layer class (any backend)."""
    return sum(_EAGER_CLASS_ATTR in type(m).__dict__ for m in model.modules())


def disable_compiled_layers(model: nn.Module) -> int:
    """Give every compiled layer its original class back (any backend); returns how many."""
    return len(class_swap("inductor").undo(model))  # undo reads only the shared marker
