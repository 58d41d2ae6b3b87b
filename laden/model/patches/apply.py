"""The activation knobs applied to one model: lean modules, fused kernels, tiled MLPs, and a report.

`apply_patches` puts `actor.lean_activations` (lean RMSNorms and gated MLPs, attention
projections that can take gradient sinks), `actor.fused_elementwise` (their elementwise math and
the rotary embeddings compiled) and `actor.tiled_mlp_tokens` (tiled MLPs with lean RMSNorms) on a
Hugging Face causal LM, before an engine wraps it, for every engine alike. The model's
`PatchOptions` go onto the modules it patches (`laden.model.patches.options`), so two models in
one process keep their own. It takes plain arguments (no config import): the caller resolves
the knobs, e.g. with `resolve_fused_elementwise`.

Every engine runs the patches: FSDP2 gathers plain parameters for a layer's forward and
backward (the autograd functions see ordinary tensors), the roundpipe engine runs shallow copies
of the patched modules on its device weights, and tensor parallelism hands DTensors to the norms
(whose fused calls run eager for tensor subclasses). Two patches cannot do their work under
tensor parallelism, whose hooks sit on every projection: the lean MLP would run Hugging Face's
forward anyway and the sink projections would never see a sink. With `tensor_parallel=True`
they are not applied and the report lists them as skipped, with the reason, instead of counting
modules that would not run lean. What depends only on the engine (the roundpipe engine alone
attaches gradient sinks and uploads weights back to back) is said by `PatchReport.describe`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from laden.model.patches.fused_rotary import enable_fused_rotary
from laden.model.patches.lean_mlp import enable_lean_mlp
from laden.model.patches.lean_norm import class_swap as lean_norm_swap
from laden.model.patches.lean_norm import enable_lean_rmsnorm
from laden.model.patches.options import PatchOptions
from laden.model.patches.sink_linear import PROJECTIONS, enable_sink_linears, is_sink_linear
from laden.model.patches.swap import decoder_layers
from laden.model.patches.tiled import enable_tiled_mlp

__all__ = ["PatchReport", "SkippedPatch", "apply_patches", "resolve_fused_elementwise"]

_SINK_ENGINE = "roundpipe"  # the one engine that attaches gradient sinks and stacks uploaded weights


@dataclass(kw_only=True, slots=True, frozen=True)
class SkippedPatch:
    """A patch that was asked for and not applied (or not to every module)."""

    patch: str
    """What was not applied, e.g. "lean MLP" or "joint projections"."""
    reason: str
    """Why, and what to change to get it."""


@dataclass(kw_only=True, slots=True, frozen=True)
class PatchReport:
    """What `apply_patches` did to one model."""

    options: PatchOptions
    """The options stored on the patched modules."""
    lean_activations: bool
    """Whether lean RMSNorms, gated MLPs and sink projections were asked for."""
    num_layers: int
    """Decoder layers of the model."""
    lean_norms: int
    """RMSNorms that keep only their input and rstd for backward."""
    lean_mlps: int
    """Gated MLPs that keep only their input, gate and up for backward."""
    sink_attention_layers: int
    """Attention layers whose four projections can add weight gradients into a gradient sink."""
    fused_rotary_layers: int
    """Attention layers whose rotary embedding runs as one fused forward and backward."""
    tiled_mlps: int
    """Decoder MLPs run over sequence tiles."""
    tile_tokens: int | None
    """Tokens per tile of the tiled MLPs; None when none is tiled."""
    skipped: tuple[SkippedPatch, ...] = ()
    """Patches asked for and not applied, with the reason."""

    def describe(self, engine_name: str) -> list[str]:
        """Log lines, each true of this model under the engine `engine_name` ("fsdp", "roundpipe", ...)."""
        lines = self._lean_lines(engine_name) + self._fused_lines() + self._joint_lines(engine_name)
        if self.tiled_mlps:
            lines.append(
                f"actor.tiled_mlp_tokens={self.tile_tokens}: {self.tiled_mlps} decoder MLPs tiled, "
                f"{self.lean_norms} RMSNorms lean"
            )
        return lines + [f"skipped {s.patch}: {s.reason}" for s in self.skipped]

    def _lean_lines(self, engine_name: str) -> list[str]:
        if not self.lean_activations:
            return []
        lines = [f"actor.lean_activations: {self.lean_norms} RMSNorms and {self.lean_mlps} gated MLPs lean"]
        if not self.sink_attention_layers:
            return lines
        if engine_name == _SINK_ENGINE:
            # A tiled MLP differentiates its tiles with the sinks suspended: its gradients go through autograd.
            mlps = "the lean MLPs' and " if self.lean_mlps and not self.tiled_mlps else ""
            lines.append(
                f"actor.lean_activations: {mlps}{self.sink_attention_layers} attention layers' projections "
                "add their weight gradients straight into the roundpipe engine's fp32 accumulators (when "
                "it computes in a lower precision)"
            )
        else:
            lines.append(
                f"actor.lean_activations: {self.sink_attention_layers} attention layers' projections run as "
                f"nn.Linear under {engine_name} (only the roundpipe engine gives them gradient sinks)"
            )
        return lines

    def _fused_lines(self) -> list[str]:
        if not self.options.fused:
            return []
        shapes = "static last dimensions" if self.options.static_last_dims else "fully dynamic shapes"
        lean = "the lean modules' elementwise math and " if self.lean_norms or self.lean_mlps else ""
        return [
            f"actor.fused_elementwise: {lean}{self.fused_rotary_layers} attention layers' rotary "
            f"embeddings run compiled ({shapes})"
        ]

    def _joint_lines(self, engine_name: str) -> list[str]:
        if not (self.options.joint_projections and (self.lean_mlps or self.sink_attention_layers)):
            return []
        if engine_name == _SINK_ENGINE:
            return [
                "joint projections: query/key/value and gate/up run as one GEMM each where the roundpipe "
                "upload puts their weights back to back"
            ]
        return [
            f"joint projections: on, but no effect under {engine_name} (its weights never lie back to "
            "back): every projection runs as its own GEMM"
        ]


def resolve_fused_elementwise(setting: bool | None, lean_activations: bool) -> bool:
    """`actor.fused_elementwise` resolved: None means on with lean activations on a CUDA machine."""
    if setting is None:
        return bool(lean_activations) and torch.cuda.is_available()
    return bool(setting)


def apply_patches(
    model: nn.Module,
    *,
    lean_activations: bool,
    fused_elementwise: bool,
    tiled_mlp_tokens: int | None,
    static_last_dims: bool = True,
    joint_projections: bool = False,
    tensor_parallel: bool = False,
) -> PatchReport:
    """Patch `model` (a Hugging Face causal LM, before an engine wraps it) as the module docstring
    says; `tensor_parallel`: the engine will split it with tensor parallelism (DTensor hooks on
    every projection). Returns what was patched and what was skipped."""
    options = PatchOptions(
        fused=fused_elementwise, static_last_dims=static_last_dims, joint_projections=joint_projections
    )
    num_layers = len(decoder_layers(model, "apply_patches"))
    skipped: list[SkippedPatch] = []
    lean_mlps = 0
    if lean_activations:
        enable_lean_rmsnorm(model, options=options)
        if tensor_parallel:
            skipped += _tensor_parallel_skips()
        else:
            lean_mlps = enable_lean_mlp(model, options=options)
            enable_sink_linears(model, options=options)
            skipped += _partial("lean MLP", lean_mlps, num_layers, _NOT_LEAN_MLP)
    fused_rotary_layers = 0
    if fused_elementwise:
        fused_rotary_layers = enable_fused_rotary(model, options=options)
        skipped += _partial("fused rotary", fused_rotary_layers, num_layers, _NOT_ROTARY)
    tiled_mlps = 0
    if tiled_mlp_tokens is not None:
        tiled_mlps = enable_tiled_mlp(model, tile_tokens=tiled_mlp_tokens)
        enable_lean_rmsnorm(model, options=options)  # long context: the norms keep no fp32 copies
    if joint_projections and not (lean_activations and not tensor_parallel):
        skipped.append(SkippedPatch(patch="joint projections", reason=_JOINT_NEEDS_LEAN))
    return PatchReport(
        options=options,
        lean_activations=lean_activations,
        num_layers=num_layers,
        lean_norms=_count_lean_norms(model),
        lean_mlps=lean_mlps,
        sink_attention_layers=_count_sink_layers(model),
        fused_rotary_layers=fused_rotary_layers,
        tiled_mlps=tiled_mlps,
        tile_tokens=tiled_mlp_tokens if tiled_mlps else None,
        skipped=tuple(skipped),
    )


_NOT_LEAN_MLP = (
    "not Hugging Face's Llama-style gated MLP with plain nn.Linear projections (see the warning); "
    "they keep Hugging Face's backward"
)
_NOT_ROTARY = "their attention does not call a module-level apply_rotary_pos_emb (see the warning)"
_JOINT_NEEDS_LEAN = (
    "only the lean MLP and the sink projections run joint projections; set actor.lean_activations=true "
    "(without tensor parallelism)"
)


def _tensor_parallel_skips() -> list[SkippedPatch]:
    return [
        SkippedPatch(
            patch="lean MLP",
            reason="tensor parallelism hooks every MLP projection (DTensor redistributions), so a lean MLP "
            "would run Hugging Face's forward anyway; the MLPs keep their own backward",
        ),
        SkippedPatch(
            patch="sink projections",
            reason="tensor parallelism's projections hold DTensor weights and no engine attaches gradient "
            "sinks to them; they stay nn.Linear",
        ),
    ]


def _partial(patch: str, applied: int, num_layers: int, why: str) -> list[SkippedPatch]:
    """A skip entry when a per-layer patch reached fewer than all decoder layers."""
    if applied >= num_layers:
        return []
    return [SkippedPatch(patch=patch, reason=f"{num_layers - applied} of {num_layers} decoder layers: {why}")]


def _count_lean_norms(model: nn.Module) -> int:
    swap = lean_norm_swap()
    return sum(swap.applied(m) for m in model.modules())


def _count_sink_layers(model: nn.Module) -> int:
    layers = decoder_layers(model, "apply_patches")
    return sum(
        all(is_sink_linear(getattr(getattr(layer, "self_attn", None), name, None)) for name in PROJECTIONS)
        for layer in layers
    )
