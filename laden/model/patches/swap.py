"""Re-classing modules: a module gets a subclass of its own class that replaces a method.

The tiled MLP (`laden.model.patches.tiled`), the lean RMSNorm (`laden.model.patches.lean_norm`) and the
compiled decoder layer (`laden.model.patches.compiled`) change one method of Hugging Face modules.
They swap each module's `__class__` to a cached subclass of its own class (the way FSDP2's
`fully_shard` re-classes a module) instead of wrapping it or binding a `forward` to the
instance: parameter names, state dicts and tied weights do not change, and shallow copies of
the module (the roundpipe engine runs layers as shells bound to device weights) keep the
new method and run on their own parameters.

`ClassSwap` owns one such family of subclasses: one per original class, named
`<prefix><original name>`, remembering the original under a marker attribute, and pickled
(and deep-copied) as "the subclass of <importable original class>", since the dynamic class
itself is not importable by name.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any, SupportsIndex

from torch import nn

__all__ = [
    "ClassSwap",
    "check_own_forward",
    "decoder_layers",
    "hookless",
    "plain_linear",
    "same_code",
    "warn_skipped",
]


class ClassSwap:
    """Subclasses `<prefix><cls>` of original classes with `methods(cls)` replaced.

    `owner` and `arg` name how an unpickling process finds this swap again:
    `importlib.import_module(owner).class_swap(arg)` must return it (or an equal one). A module
    with one swap binds `class_swap = _SWAP.lookup`.
    """

    def __init__(
        self,
        *,
        prefix: str,
        marker: str,
        methods: Callable[[type[nn.Module]], dict[str, Any]],
        owner: str,
        arg: Any = None,
    ) -> None:
        self.prefix, self.marker, self.methods = prefix, marker, methods
        self.owner, self.arg = owner, arg
        self._classes: dict[type, type] = {}

    def subclass(self, cls: type[nn.Module]) -> type[nn.Module]:
        """The subclass for original class `cls` (one per class)."""
        if cls not in self._classes:
            self._classes[cls] = type(
                f"{self.prefix}{cls.__name__}",
                (cls,),
                {
                    **self.methods(cls),
                    "__reduce_ex__": _swapped_reduce_ex,
                    "_laden_swap": self,
                    self.marker: cls,
                    "__module__": self.owner,
                },
            )
        return self._classes[cls]

    def lookup(self, arg: object = None) -> ClassSwap:
        """This swap, whatever `arg`: the `class_swap` of a module that owns only this one."""
        return self

    def applied(self, module: nn.Module) -> bool:
        return self.marker in type(module).__dict__

    def original(self, module: nn.Module) -> type[nn.Module]:
        return type(module).__dict__[self.marker]

    def apply(self, module: nn.Module) -> None:
        """Re-class `module` (nothing if it already is)."""
        if not self.applied(module):
            module.__class__ = self.subclass(type(module))

    def apply_all(self, modules: Sequence[nn.Module]) -> int:
        """Re-class every module of `modules` (checked by the caller before any is switched); how many."""
        for module in modules:
            self.apply(module)
        return len(modules)

    def undo(self, model: nn.Module) -> list[nn.Module]:
        """Give every re-classed module of `model` its original class back; return them."""
        undone = [m for m in model.modules() if self.applied(m)]
        for module in undone:
            module.__class__ = self.original(module)
        return undone


def warn_skipped(skipped: set[str], left: str, why: str) -> None:
    """The one warning of an `enable_*` function about the modules it left alone: "`left` <the
    `skipped` names, sorted> as is: `why`", reported at the enable function's caller."""
    if skipped:
        warnings.warn(f"{left} {', '.join(sorted(skipped))} as is: {why}", stacklevel=3)


def _swapped_reduce_ex(self: nn.Module, protocol: SupportsIndex) -> tuple:
    reduced = object.__reduce_ex__(self, protocol)
    assert isinstance(reduced, tuple), "a module instance reduces to a tuple"
    swap: ClassSwap = type(self)._laden_swap  # type: ignore[attr-defined]
    return (_new_swapped, (swap.owner, swap.arg, swap.original(self)), *reduced[2:])


def _new_swapped(owner: str, arg: Any, cls: type[nn.Module]) -> nn.Module:
    """Unpickling / copying a re-classed module: an empty instance of its subclass, state set after."""
    swap: ClassSwap = importlib.import_module(owner).class_swap(arg)
    return object.__new__(swap.subclass(cls))


def decoder_layers(model: nn.Module, who: str, hint: str = "") -> nn.ModuleList:
    """The decoder layers of a Hugging Face causal LM (or of its base model); `who` names the caller."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else getattr(model, "model", model)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"{type(model).__name__} has no decoder layers at `model.model.layers`; {who} expects a Hugging "
            f"Face causal LM (or its base model) laid out like Qwen3, Qwen2, Llama or Mistral{hint}"
        )
    return layers


def plain_linear(module: object) -> bool:
    """An `nn.Linear` running `nn.Linear.forward` (not a LoRA or quantised layer) without hooks: a
    module whose computation is exactly `F.linear(x, weight, bias)`."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward and hookless(module)


def hookless(module: nn.Module) -> bool:
    """No forward or backward hooks on `module` itself (its call is exactly its class's forward)."""
    return not (
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
    )


def check_own_forward(module: nn.Module, where: str, bypasses: str) -> None:
    """Refuse a module whose `forward` was replaced on the instance: re-classing would not reach it."""
    if "forward" in module.__dict__:
        raise ValueError(
            f"{where} has its forward replaced on the instance (e.g. by accelerate's device_map hooks), "
            f"which would bypass {bypasses}; load the model without a device_map"
        )


_CODE_FIELDS = ("co_code", "co_consts", "co_names", "co_varnames", "co_argcount", "co_kwonlyargcount")


def same_code(fn: object, reference: object) -> bool:
    """Whether function `fn` compiles to the same code as `reference` (a copy of a library method's
    statements, names included): how a swap recognises the exact forward it replaces."""
    code = getattr(fn, "__code__", None)
    ref = getattr(reference, "__code__", None)
    return (
        code is not None
        and ref is not None
        and all(getattr(code, f) == getattr(ref, f) for f in _CODE_FIELDS)
    )
