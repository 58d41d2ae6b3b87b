"""Per-call run settings of the library API (`RoundPipeRunConfig`) and their resolution.

A setting left at None falls back to the model's default config (given to `RoundPipe`),
then to the built-in default. The knobs are the ones the OOM guide turns: more
`num_microbatch` lowers the GPU peak (smaller micro-batches) and raises host activation
memory; `recompute_grain="layer"` lowers the GPU peak further at the price of moving every
layer's input through host memory; a plan with smaller stages lowers weight memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from laden.engine.roundpipe.plan import ModelExecutePlan

Grain = Literal["stage", "layer"]
GRAINS = ("stage", "layer")
SplitInput = Callable[[tuple, dict[str, Any], int], tuple[list[tuple], list[dict[str, Any]]]] | tuple


@dataclass(slots=True)
class RoundPipeRunConfig:
    """Run settings for one `forward_backward` / `forward` call; None = the model's default.

    Positional order as in the engine this API mirrors: `requires_grad, output_device,
    preserve_rng_state, recompute_grain, num_microbatch, split_input, split_label,
    merge_output, execute_plan`.
    """

    requires_grad: bool | None = None
    """Whether `forward` records a graph (default: `torch.is_grad_enabled()`); see `RoundPipe.forward`."""
    output_device: torch.device | str | None = None
    """Where merged outputs (and `forward_backward` losses) are placed (default: the CPU)."""
    preserve_rng_state: bool | None = None
    """Replay the forward's RNG during recompute so dropout masks match (default True)."""
    recompute_grain: Grain | None = None
    """Backward recompute per stage (`stage`, default, faster) or per layer (`layer`, lower GPU peak)."""
    num_microbatch: int | None = None
    """Micro-batches the batch is split into along dim 0 (default: number of devices + 1)."""
    split_input: SplitInput | None = None
    """`(args_spec, kwargs_spec)` of `TensorChunkSpec(dim)` / `_Replicate` markers (None: automatic), or
    a function `(args, kwargs, n) -> (args_list, kwargs_list)`; default splits tensors along dim 0."""
    split_label: Any = None
    """A spec like `split_input`'s for the label, or a function `(label, n) -> label_list`."""
    merge_output: Any = None
    """None/True: concatenate tensors on dim 0 and average scalar tensors; a spec of
    `TensorChunkSpec(dim)` / `_Replicate` / `_CustomReducer`; a function `outputs_list -> output`;
    False: the per-micro-batch outputs as a list per leaf (`batching.merge_outputs`)."""
    execute_plan: ModelExecutePlan | None = None
    """Layer ranges per stage; default `ModelExecutePlan.auto` for the model."""

    def __post_init__(self) -> None:
        if self.num_microbatch is not None and (
            not isinstance(self.num_microbatch, int) or self.num_microbatch < 1
        ):
            raise ValueError(f"num_microbatch={self.num_microbatch!r} must be a positive integer, e.g. 4")
        if self.recompute_grain is not None and self.recompute_grain not in GRAINS:
            raise ValueError(f"recompute_grain={self.recompute_grain!r} must be one of {GRAINS}")
        if self.execute_plan is not None and not isinstance(self.execute_plan, ModelExecutePlan):
            raise ValueError(
                f"execute_plan must be a ModelExecutePlan; got {type(self.execute_plan).__name__}. "
                "Build one with ModelExecutePlan.auto(...) or ModelExecutePlan(fwd_plan=..., bwd_plan=...)"
            )
        spec = self.split_input
        if spec is not None and not callable(spec) and not (isinstance(spec, tuple) and len(spec) == 2):
            raise ValueError(
                "split_input must be a function (args, kwargs, n) -> (args_list, kwargs_list) or a pair "
                "(args_spec, kwargs_spec), e.g. ((TensorChunkSpec(0), _Replicate), None)"
            )


@dataclass(frozen=True, slots=True)
class ResolvedRunConfig:
    """A run config with every default applied."""

    num_microbatch: int
    recompute_grain: Grain
    execute_plan: ModelExecutePlan | None
    split_input: Any
    split_label: Any
    preserve_rng_state: bool
    requires_grad: bool | None
    output_device: torch.device | None
    merge_output: Any


def resolve(
    call: RoundPipeRunConfig | None, model: RoundPipeRunConfig, *, num_devices: int
) -> ResolvedRunConfig:
    """Merge a call's settings over the model's defaults over the built-in ones."""
    call = call or RoundPipeRunConfig()

    def pick(name: str, default: Any) -> Any:
        value = getattr(call, name)
        if value is None:
            value = getattr(model, name)
        return default if value is None else value

    return ResolvedRunConfig(
        num_microbatch=pick("num_microbatch", num_devices + 1),
        recompute_grain=pick("recompute_grain", "stage"),
        execute_plan=pick("execute_plan", None),
        split_input=pick("split_input", None),
        split_label=pick("split_label", None),
        preserve_rng_state=pick("preserve_rng_state", True),
        requires_grad=pick("requires_grad", None),
        output_device=None if (device := pick("output_device", None)) is None else torch.device(device),
        merge_output=pick("merge_output", True),
    )
