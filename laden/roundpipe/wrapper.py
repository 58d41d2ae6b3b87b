"""`wrap_model_to_roundpipe` and `AutoRoundPipe`: wrapping a model without writing it as a Sequential.

    model = wrap_model_to_roundpipe(my_model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)

A Hugging Face causal LM laden can split (`laden.model.split`) is its "preset": it becomes
one `RoundPipe` over its layers. Any other model is walked from the root, as in the API laden
mirrors: a module in `skip_modules` stays as it is (runs on the host); an `nn.Sequential`
becomes a `RoundPipe` of its children; a module with a `forward` whose own tensors are at
least `lower_threshold` bytes, or whose whole size is at most `upper_threshold`, becomes a
one-layer `RoundPipe` (one micro-batch when it is under `lower_threshold`, where splitting
gains nothing); an `nn.ModuleList` has each element wrapped (all but the last with
`merge_output=False`, so that a chain of them passes micro-batches on unmerged); anything
else is recursed into, its own `forward` running on the host. A root that did not become a
`RoundPipe` is returned as an `AutoRoundPipe`: its forward is the model's, its optimizer
parameters the master weights of every `RoundPipe` inside it plus the parameters used on
the host, and `step` updates them all with one call of `step_fn`.

Deliberate differences: `AutoRoundPipe.step` is always synchronous (the update is exact; the
asynchronous one-step-stale update would need every inner `RoundPipe` to share one
optimizer thread); parameters used on the host are their own master weights, so an
`optim_dtype` other than their dtype is refused; a Hugging Face model's `loss_function` is
not wrapped (it runs where its inputs are, on the host).
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Callable, Container, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from laden.engine.roundpipe.context import OptimizerCtx
from laden.engine.roundpipe.device import default_devices
from laden.roundpipe.api import ForwardsAttributes, MasterParameterViews, RoundPipe
from laden.roundpipe.run_config import RoundPipeRunConfig
from laden.roundpipe.timer import module_bytes


class AutoRoundPipe(ForwardsAttributes, MasterParameterViews, nn.Module):
    """A model with `RoundPipe`s inside it: its forward, and one optimizer over all of its parameters.

    model: the module (its `RoundPipe` submodules run on the devices, the rest on the host).
    name: a label. optim_dtype: the master dtype the inner `RoundPipe`s were built with; the
    host parameters must already be of it (they are their own masters).
    `forward_backward` is not available: the model's forward is arbitrary Python.
    """

    def __init__(
        self, model: nn.Module, name: str | None = None, optim_dtype: torch.dtype | None = None, **kwargs: Any
    ) -> None:
        super().__init__()
        self.model = model
        self.name = name or type(model).__name__
        self.optim_dtype = optim_dtype
        self._warned_async = False
        if optim_dtype is not None:
            for pname, p in self._host_named_parameters():
                if p.dtype != optim_dtype:
                    raise ValueError(
                        f"optim_dtype={optim_dtype} but {pname} ({p.dtype}) runs on the host, where laden keeps "
                        "no separate master copy; convert the model to that dtype or leave optim_dtype unset"
                    )
        self._initialized = True  # from here on, new public attributes are written to the model

    def inner_roundpipes(self) -> list[RoundPipe]:
        return [m for m in self.model.modules() if isinstance(m, RoundPipe)]

    def _host_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        inside = {id(p) for rp in self.inner_roundpipes() for p in nn.Module.parameters(rp)}
        for pname, p in self.model.named_parameters():
            if id(p) not in inside:
                yield pname, p

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def forward_backward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"AutoRoundPipe {self.name!r} has no forward_backward: its forward is the model's own Python, "
            "not a chain of layers. Call it, then loss.backward(); or pass an nn.Sequential to wrap it whole"
        )

    def optim_named_parameters(
        self, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """(name, master weight) of every trainable parameter: inner masters and host parameters."""
        names = {id(m): n for n, m in self.model.named_modules()}
        dot = f"{prefix}." if prefix else ""
        for rp in self.inner_roundpipes():
            yield from rp.optim_named_parameters(f"{dot}{names[id(rp)]}", remove_duplicate)
        for pname, p in self._host_named_parameters():
            if p.requires_grad:
                yield f"{dot}{pname}", p

    def step(self, step_fn: Callable[..., Any], is_async: bool = True, *args: Any, **kwargs: Any) -> None:
        """Hand every inner `RoundPipe`'s gradients to its masters, run `step_fn` once, refresh the weights.

        Always synchronous (module docstring); `is_async=True` warns once.
        """
        if is_async and not self._warned_async:
            warnings.warn(
                f"AutoRoundPipe {self.name!r}: step(is_async=True) runs synchronously (one optimizer over several "
                "RoundPipes); pass is_async=False to silence this",
                stacklevel=2,
            )
            self._warned_async = True
        inner = self.inner_roundpipes()
        for rp in inner:
            rp.step(lambda: None, is_async=False)  # gradients onto the masters' .grad, nothing updated yet
        with OptimizerCtx():
            step_fn(*args, **kwargs)
        for rp in inner:
            rp.synchronize()  # the updated masters into every upload buffer

    def synchronize(self) -> None:
        for rp in self.inner_roundpipes():
            rp.synchronize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for rp in self.inner_roundpipes():
            rp.zero_grad(set_to_none)
        for _, p in self._host_named_parameters():
            p.grad = None


def wrap_model_to_roundpipe(
    model: nn.Module,
    use_sequential_preset: bool | None = None,
    lower_threshold: int = 16 * 1024,
    upper_threshold: int | None = None,
    skip_modules: Container[nn.Module] = (),
    override_config: Mapping[nn.Module, RoundPipeRunConfig] | None = None,
    model_run_config: RoundPipeRunConfig | None = None,
    name: str | None = None,
    **roundpipe_kwargs: Any,
) -> RoundPipe | AutoRoundPipe:
    """`model` as a `RoundPipe` (a preset or a Sequential) or an `AutoRoundPipe` (module docstring).

    use_sequential_preset: None/True try the preset (None says so on stderr), False skips it;
    True raises NotImplementedError for a model without one. upper_threshold: default the
    model's bytes / (devices + 1). roundpipe_kwargs: passed to every `RoundPipe`.
    """
    name = name or type(model).__name__
    run_config = model_run_config or RoundPipeRunConfig()
    overrides = dict(override_config or {})
    if use_sequential_preset is not False and _has_preset(model):
        if use_sequential_preset is None:
            print(
                f"[INFO] model {name!r} of type {type(model).__name__} is split by laden's causal-LM preset; "
                "pass use_sequential_preset=False to wrap it module by module instead",
                file=sys.stderr,
            )
        return RoundPipe(model, name=name, model_run_config=run_config, **roundpipe_kwargs)
    if use_sequential_preset is True:
        raise NotImplementedError(
            f"no sequential preset for {type(model).__name__}: laden's presets are the Hugging Face causal LMs "
            "laden.model.split supports; pass use_sequential_preset=None or False"
        )
    if upper_threshold is None:
        devices = roundpipe_kwargs.get("devices") or default_devices()
        upper_threshold = module_bytes(model) // (len(devices) + 1)
    walk = _Walk(
        lower=lower_threshold,
        upper=upper_threshold,
        skip=skip_modules,
        overrides=overrides,
        kwargs=roundpipe_kwargs,
    )
    wrapped = walk.wrap(model, run_config, name)
    if isinstance(wrapped, RoundPipe):
        return wrapped
    return AutoRoundPipe(wrapped, name=name, **roundpipe_kwargs)


def _has_preset(model: nn.Module) -> bool:
    return hasattr(getattr(model, "config", None), "model_type") and hasattr(model, "lm_head")


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


@dataclasses.dataclass(kw_only=True, slots=True)
class _Walk:
    """The recursive wrapping rule of `wrap_model_to_roundpipe` (module docstring)."""

    lower: int
    """Own bytes from which a module with a forward is wrapped whole."""
    upper: int
    """Total bytes up to which a module with a forward is wrapped whole."""
    skip: Container[nn.Module]
    """Modules left as they are (run on the host)."""
    overrides: dict[nn.Module, RoundPipeRunConfig]
    """Per-module run configs."""
    kwargs: dict[str, Any]
    """Passed to every `RoundPipe`."""

    def pipe(self, module: nn.Module, config: RoundPipeRunConfig, name: str) -> RoundPipe:
        return RoundPipe(
            module, name=name, model_run_config=self.overrides.get(module, config), **self.kwargs
        )

    def wrap(self, module: nn.Module, config: RoundPipeRunConfig, name: str) -> nn.Module:
        if module in self.skip:
            return module
        if isinstance(module, nn.Sequential):
            return self.pipe(module, config, name)
        own = sum(t.numel() * t.element_size() for t in [*module.parameters(False), *module.buffers(False)])
        total = module_bytes(module)
        if (own >= self.lower or total <= self.upper) and _has_forward(module):
            if total < self.lower and module not in self.overrides:
                config = dataclasses.replace(config, num_microbatch=1)  # too small to gain from micro-batches
            return self.pipe(module, config, name)
        if isinstance(module, nn.ModuleList):
            unmerged = dataclasses.replace(config, merge_output=False)  # chained: micro-batches passed on
            for i in range(len(module)):
                last = i == len(module) - 1
                module[i] = self.pipe(module[i], config if last else unmerged, f"{name}.{i}")
            return module
        for child_name, child in list(module.named_children()):
            wrapped = self.wrap(child, config, f"{name}.{child_name}")
            if wrapped is not child:
                setattr(module, child_name, wrapped)
        return module
