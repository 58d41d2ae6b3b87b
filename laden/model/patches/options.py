"""Per-model patch options: the kernel choices a patched module runs with, kept on the module.

The lean RMSNorm and the lean gated MLP read these from the module they patched (its
`__dict__`), at every call; the fused rotary embedding from its module's class (one subclass per
original class and options: the rotation is called without its module); the sink linears'
attention modules carry the joint-projection hooks only where they were asked for. None reads a
module-level switch: two models in one process (a trainer and a rollout engine, a fused model
next to an eager reference) each keep their own. Shallow copies (the roundpipe engine's shells),
deep copies and pickles carry them with the module. The cost is one dictionary lookup per call and one more argument for the
autograd functions. What stays process-wide in `laden.model.patches.fused` are caches (compiled
code, functions that failed to compile): they change how long a call takes, never its math.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from torch import nn

__all__ = ["EAGER", "PatchOptions", "clear_options", "options_of", "set_options"]

_ATTR = "_laden_patch_options"


@dataclass(kw_only=True, slots=True, frozen=True)
class PatchOptions:
    """How the patched modules of one model compute (`laden.model.patches.apply.apply_patches`)."""

    fused: bool = False
    """Elementwise math through `torch.compile` (`actor.fused_elementwise`); False: eager ops."""
    static_last_dims: bool = True
    """Compile fused functions with each tensor's last dimension fixed (False: fully dynamic)."""
    joint_projections: bool = False
    """One GEMM for projections of one input whose weights lie back to back (`patches.stacked`)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, bool):
                raise ValueError(f"PatchOptions.{f.name}={value!r} must be a bool (True or False)")


EAGER = PatchOptions()  # Hugging Face's eager ops, joint projections off


def options_of(module: nn.Module) -> PatchOptions:
    """The options `module` was patched with (`EAGER` for a module that carries none)."""
    return module.__dict__.get(_ATTR, EAGER)


def set_options(module: nn.Module, options: PatchOptions) -> None:
    if not isinstance(options, PatchOptions):
        raise ValueError(
            f"options={options!r} must be a laden.model.patches.options.PatchOptions, "
            f"e.g. PatchOptions(fused=True)"
        )
    module.__dict__[_ATTR] = options


def clear_options(module: nn.Module) -> None:
    module.__dict__.pop(_ATTR, None)
