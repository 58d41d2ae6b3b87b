"""Execution plans: which layers share a GPU residency in forward and in backward.

A plan is two lists of layer ranges. `fwd_plan` lists the forward stages in execution
order; `bwd_plan` lists the backward stages in execution order, so it runs from the last
layers to the first. In a "fused" plan (training), `bwd_plan[0]` is the stage that runs
forward, loss and backward in one residency, and `fwd_plan` covers only the layers before
it; the two partitions may differ (e.g. fewer, larger stages in forward, where no
gradients take memory).

`ModelExecutePlan.auto` partitions by bytes, not timings: a stage's weights (forward) or
weights plus gradient accumulators (backward) must fit in `model_memory_limit / 2` GiB,
because the next stage's weights are prefetched while the current one computes. Within
that cap stages are balanced (the largest stage is as small as the stage count allows) and
there are at least `min_stages` of them (one per device by default). Trade-off: bytes are
known before the first step and deterministic; measured timings would balance better when
layers differ in FLOPs but not in size (the embedding), at the price of a profiling step.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Literal, Protocol

import torch

RunType = Literal["infer", "train", "fused"]
_RUN_TYPES = ("infer", "train", "fused")
GIB = 1 << 30
DEFAULT_MEMORY_FRACTION = 0.6


class PlannableModel(Protocol):
    """What `auto` needs to know about a model: per-layer weight and gradient bytes, and its devices."""

    @property
    def num_layers(self) -> int: ...

    def layer_bytes(self, *, with_grads: bool) -> list[int]: ...

    @property
    def num_devices(self) -> int: ...

    def default_memory_limit_gib(self) -> float: ...


class ModelExecutePlan:
    """Layer ranges per forward stage and per backward stage (see the module docstring)."""

    def __init__(
        self, fwd_plan: Sequence[range] | None = None, bwd_plan: Sequence[range] | None = None
    ) -> None:
        self.fwd_plan: list[range] = list(fwd_plan or [])
        self.bwd_plan: list[range] = list(bwd_plan or [])

    def __repr__(self) -> str:
        return f"ModelExecutePlan(fwd_plan={self.fwd_plan}, bwd_plan={self.bwd_plan})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModelExecutePlan) and (self.fwd_plan, self.bwd_plan) == (
            other.fwd_plan,
            other.bwd_plan,
        )

    def check_valid(self, num_layers: int, run_type: RunType) -> None:
        """Raise ValueError unless the plan covers every layer exactly once, in order, for `run_type`."""
        if run_type not in _RUN_TYPES:
            raise ValueError(f"run_type={run_type!r} must be one of {_RUN_TYPES}")
        fwd_end = _check_contiguous(self.fwd_plan, "fwd_plan", start=0)
        if run_type in ("infer", "train") and fwd_end != num_layers:
            raise ValueError(f"fwd_plan covers layers [0, {fwd_end}); it must cover all {num_layers} layers")
        if run_type == "infer":
            return
        if not self.bwd_plan:
            raise ValueError(f"bwd_plan is empty; a {run_type} plan needs backward stages")
        bwd_end = _check_contiguous(list(reversed(self.bwd_plan)), "bwd_plan (reversed)", start=0)
        if bwd_end != num_layers:
            raise ValueError(f"bwd_plan covers layers [0, {bwd_end}); it must cover all {num_layers} layers")
        if run_type == "fused" and self.bwd_plan[0].start != fwd_end:
            raise ValueError(
                f"fused plan: fwd_plan covers layers [0, {fwd_end}) but the fused stage bwd_plan[0] starts at "
                f"layer {self.bwd_plan[0].start}; the forward stages must cover exactly the layers before it"
            )

    def forward_stages(self, num_layers: int) -> list[range]:
        """The forward stages for an inference run: `fwd_plan`, plus the fused stage of a fused plan."""
        stages = list(self.fwd_plan)
        covered = stages[-1].stop if stages else 0
        if covered < num_layers and self.bwd_plan:
            stages.append(self.bwd_plan[0])
        return stages

    @classmethod
    def uniform(
        cls,
        num_layers: int,
        *,
        stage_layers: int,
        fused_layers: int | None = None,
        fwd_stage_layers: int | None = None,
    ) -> ModelExecutePlan:
        """A fused plan with fixed stage sizes (counted in layers, not bytes).

        The fused stage holds the last `fused_layers` layers (default `stage_layers`); the
        layers before it form backward stages of `stage_layers` (the first one may be shorter)
        and forward stages of `fwd_stage_layers` (default `stage_layers`). With stage-grain
        recompute, `stage_layers` bounds the layers whose activations are alive at once.
        """
        fused = stage_layers if fused_layers is None else fused_layers
        fwd_size = stage_layers if fwd_stage_layers is None else fwd_stage_layers
        for name, value in (
            ("stage_layers", stage_layers),
            ("fused_layers", fused),
            ("fwd_stage_layers", fwd_size),
        ):
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1 layer")
        fused = min(fused, num_layers)
        rest = num_layers - fused
        bwd = [range(num_layers - fused, num_layers)]
        bwd += [range(max(0, stop - stage_layers), stop) for stop in range(rest, 0, -stage_layers)]
        fwd = [range(start, min(start + fwd_size, rest)) for start in range(0, rest, fwd_size)]
        return cls(fwd_plan=fwd, bwd_plan=bwd)

    @classmethod
    def auto(
        cls,
        run_type: RunType,
        model: PlannableModel,
        /,
        *,
        min_stages: int | None = None,
        model_memory_limit: float | None = None,
        upper_threshold: float | None = None,
    ) -> ModelExecutePlan:
        """A plan whose stages fit `model_memory_limit` GiB (two stages in flight) and are balanced.

        model_memory_limit: GiB of device memory for stage weights (+ gradient accumulators
        in backward), split between the stage computing and the one prefetching; default
        60% of the smallest device's memory.
        upper_threshold: accepted for compatibility with timing-based planners and ignored
        (this planner balances bytes), with a warning.
        """
        if upper_threshold is not None:
            warnings.warn(
                f"ModelExecutePlan.auto(upper_threshold={upper_threshold}) is ignored: laden balances stages "
                "by bytes, not by timings; use min_stages or model_memory_limit to shape the plan",
                stacklevel=2,
            )
        if run_type not in _RUN_TYPES:
            raise ValueError(f"run_type={run_type!r} must be one of {_RUN_TYPES}")
        limit_gib = model.default_memory_limit_gib() if model_memory_limit is None else model_memory_limit
        if not limit_gib > 0:
            raise ValueError(f"model_memory_limit={model_memory_limit} must be > 0 GiB")
        cap = int(limit_gib * GIB / 2)
        stages = model.num_devices if min_stages is None else min_stages
        if stages < 1:
            raise ValueError(f"min_stages={min_stages} must be >= 1")
        fwd_bytes = model.layer_bytes(with_grads=False)
        bwd_bytes = model.layer_bytes(with_grads=True)
        _warn_if_oversized(bwd_bytes if run_type != "infer" else fwd_bytes, cap, limit_gib)
        if run_type == "infer":
            return cls(fwd_plan=balanced_partition(fwd_bytes, cap, stages))
        bwd = balanced_partition(bwd_bytes, cap, stages)[::-1]  # execution order: last layers first
        if run_type == "train":
            return cls(fwd_plan=balanced_partition(fwd_bytes, cap, stages), bwd_plan=bwd)
        fused_start = bwd[0].start
        fwd = (
            balanced_partition(fwd_bytes[:fused_start], cap, min(stages, fused_start)) if fused_start else []
        )
        return cls(fwd_plan=fwd, bwd_plan=bwd)


def _check_contiguous(stages: Sequence[range], name: str, *, start: int) -> int:
    expected = start
    for i, stage in enumerate(stages):
        if not isinstance(stage, range) or stage.step != 1 or len(stage) == 0:
            raise ValueError(f"{name}[{i}]={stage!r} must be a non-empty range(start, stop) of layer indices")
        if stage.start != expected:
            raise ValueError(
                f"{name}[{i}]={stage!r} starts at layer {stage.start}; expected layer {expected}"
            )
        expected = stage.stop
    return expected


def balanced_partition(sizes: Sequence[int], cap: int, min_parts: int) -> list[range]:
    """Contiguous ranges over `sizes`, each within `cap` when possible, as balanced as their count allows.

    The count is the larger of `min_parts` (at most one part per item) and the fewest parts
    that fit the cap; the largest part is then minimised by a binary search over thresholds.
    """
    n = len(sizes)
    if n == 0:
        return []
    largest = max(sizes)
    needed = _count_parts(sizes, max(cap, largest))
    parts = min(n, max(min_parts, needed))
    lo, hi = largest, max(sum(sizes), largest)
    while lo < hi:  # smallest threshold that yields <= parts groups
        mid = (lo + hi) // 2
        if _count_parts(sizes, mid) <= parts:
            hi = mid
        else:
            lo = mid + 1
    return _split(sizes, lo, parts)


def _count_parts(sizes: Sequence[int], threshold: int) -> int:
    count, acc = 1, 0
    for s in sizes:
        if acc and acc + s > threshold:
            count, acc = count + 1, 0
        acc += s
    return count


def _split(sizes: Sequence[int], threshold: int, parts: int) -> list[range]:
    """Greedy split under `threshold`, then split the largest ranges until there are `parts`."""
    ranges: list[range] = []
    start, acc = 0, 0
    for i, s in enumerate(sizes):
        if acc and acc + s > threshold:
            ranges.append(range(start, i))
            start, acc = i, 0
        acc += s
    ranges.append(range(start, len(sizes)))
    while len(ranges) < parts:
        k = max(
            (i for i, r in enumerate(ranges) if len(r) > 1), key=lambda i: sum(sizes[j] for j in ranges[i])
        )
        r = ranges[k]
        mid = r.start + len(r) // 2
        ranges[k : k + 1] = [range(r.start, mid), range(mid, r.stop)]
    return ranges


def _warn_if_oversized(sizes: Sequence[int], cap: int, limit_gib: float) -> None:
    if sizes and max(sizes) > cap:
        need = 2 * max(sizes) / GIB
        warnings.warn(
            f"the largest layer needs {max(sizes) / GIB:.3g} GiB, more than half of model_memory_limit="
            f"{limit_gib} GiB; it gets a stage of its own. Raise model_memory_limit to >= {need:.3g} GiB "
            "or split that layer",
            stacklevel=3,
        )


def default_memory_limit_gib(devices: Sequence[torch.device]) -> float:
    """60% of the smallest device's memory (host RAM when the device is the CPU)."""
    totals = []
    for d in devices:
        if d.type == "cuda":
            totals.append(torch.cuda.get_device_properties(d).total_memory)
        else:
            totals.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return DEFAULT_MEMORY_FRACTION * min(totals) / GIB
