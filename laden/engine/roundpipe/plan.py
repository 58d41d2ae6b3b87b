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
there are at least `min_stages` of them (one per device by default). The fused stage is
the exception with `recompute_grain="stage"`: it is then grown from the end for as long as
it fits the whole limit beside what is resident with it (`_grow_fused`), because its layers
are the only ones that skip the backward recompute; a model that fits whole is one stage,
trained without recompute. (With `"layer"` the fused stage recomputes too: not grown.)
Trade-off: bytes are known before the first step and deterministic; measured timings would
balance better when layers differ in FLOPs but not in size (the embedding), at the price of
a profiling step.

Given the tokens of a micro-batch (`tokens_per_microbatch`), the stage that computes also
counts its activations, from the model's own per-layer estimate (`layer_activation_bytes`:
what a layer's forward keeps for its backward, and what it allocates on top while it runs):
with `recompute_grain="stage"` the kept activations of all the stage's layers plus the
largest transient of one of them; with `"layer"` only the largest layer's kept and
transient bytes. Without a token count (or an estimate) the plan counts weights only:
fine for short micro-batches, an out-of-memory error for long ones (16k tokens through
eight Qwen3-1.7B decoder layers keep ~15 GiB of activations). Activations are charged against the
same half of the limit as the weights, so the prefetched stage is budgeted as if it
computed too: conservative by one stage's activations, for a plain contiguous partition.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Literal, Protocol, overload

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


class SharedWeights(Protocol):
    """Optional for `auto`: parameters several layers use (tied embeddings), (layers, bytes) each."""

    def shared_bytes(self, *, with_grads: bool) -> list[tuple[frozenset[int], int]]: ...


class ActivationEstimator(Protocol):
    """Optional for `auto`: per layer, (kept, transient) activation bytes of a `num_tokens` micro-batch."""

    def layer_activation_bytes(self, num_tokens: int) -> list[tuple[int, int]]: ...


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

    @overload
    @classmethod
    def auto(
        cls, run_type: RunType, model: PlannableModel, /, *, min_stages: int | None = ...,
        model_memory_limit: float | None = ..., upper_threshold: float | None = ...,
        tokens_per_microbatch: int | None = ..., recompute_grain: Literal["stage", "layer"] = ...,
    ) -> ModelExecutePlan: ...  # fmt: skip
    @overload
    @classmethod
    def auto(
        cls, run_type: RunType, model1: PlannableModel, model2: PlannableModel, /, *models: PlannableModel,
        min_stages: int | None = ..., model_memory_limit: float | None = ..., upper_threshold: float | None = ...,
        tokens_per_microbatch: int | None = ..., recompute_grain: Literal["stage", "layer"] = ...,
    ) -> list[ModelExecutePlan]: ...  # fmt: skip
    @classmethod
    def auto(
        cls,
        run_type: RunType,
        /,
        *models: PlannableModel,
        min_stages: int | None = None,
        model_memory_limit: float | None = None,
        upper_threshold: float | None = None,
        tokens_per_microbatch: int | None = None,
        recompute_grain: Literal["stage", "layer"] = "stage",
    ) -> ModelExecutePlan | list[ModelExecutePlan]:
        """A plan whose stages fit `model_memory_limit` GiB (two stages in flight) and are balanced.

        Several models (`auto(run_type, model1, model2, ...)`) that run one after the other get
        one plan each of `run_type`, in a list, under one stage bound (`plan_joint.py`).

        model_memory_limit: GiB of device memory for stage weights (+ gradient accumulators
        in backward, + activations with `tokens_per_microbatch`), split between the stage
        computing and the one prefetching; default 60% of the smallest device's memory.
        tokens_per_microbatch: tokens of the largest micro-batch; counts activations with the
        model's `layer_activation_bytes` estimate (a model without one: weights only).
        recompute_grain: the backward recompute the plan is for (`stage` keeps a stage's
        activations alive at once, `layer` one layer's).
        upper_threshold: the most a stage may cost, as a multiple (>= 1) of the costliest single
        layer (over forward and backward stages); laden's costs are bytes, not timings. Tighter
        than the memory cap, it gives more, smaller stages, and the fused stage is not grown
        past it. None (laden's default, where the timing-based planner it mirrors uses 1.1):
        no such bound.
        """
        if len(models) != 1:
            from laden.engine.roundpipe.plan_joint import joint_plans

            return joint_plans(
                cls, run_type, models, min_stages=min_stages, model_memory_limit=model_memory_limit,
                upper_threshold=upper_threshold, tokens_per_microbatch=tokens_per_microbatch,
                recompute_grain=recompute_grain,
            )  # fmt: skip
        model = models[0]
        if run_type not in _RUN_TYPES:
            raise ValueError(f"run_type={run_type!r} must be one of {_RUN_TYPES}")
        if recompute_grain not in ("stage", "layer"):
            raise ValueError(f"recompute_grain={recompute_grain!r} must be 'stage' or 'layer'")
        limit_gib = model.default_memory_limit_gib() if model_memory_limit is None else model_memory_limit
        if not limit_gib > 0:
            raise ValueError(f"model_memory_limit={model_memory_limit} must be > 0 GiB")
        cap = int(limit_gib * GIB / 2)
        stages = model.num_devices if min_stages is None else min_stages
        if stages < 1:
            raise ValueError(f"min_stages={min_stages} must be >= 1")
        fwd, bwd, bwd_bytes = layer_costs(model, tokens_per_microbatch, recompute_grain)
        _warn_if_oversized(bwd if run_type != "infer" else fwd, cap, limit_gib, tokens_per_microbatch)
        bound = None if upper_threshold is None else stage_bound(upper_threshold, fwd, bwd, run_type)
        if bound is not None:
            cap = min(cap, bound)
        if run_type == "infer":
            return cls(fwd_plan=fwd.partition(cap, stages))
        if run_type == "train":
            return cls(fwd_plan=fwd.partition(cap, stages), bwd_plan=bwd.partition(cap, stages)[::-1])
        # A fused run keeps a tied weight's gradient from the fused stage on the device until its
        # owner's stage (`carried_params`): the backward stages after the fused one share the
        # limit with it.
        shared = getattr(model, "shared_bytes", None)
        shared_with_grads = shared(with_grads=True) if shared is not None else []
        shared_weights = shared(with_grads=False) if shared is not None else []
        carried = sum(n for _, n in shared_with_grads) - sum(n for _, n in shared_weights)  # their gradients
        bwd_cap = max(1, (int(limit_gib * GIB) - carried) // 2)
        if bound is not None:
            bwd_cap = min(bwd_cap, bound)
        bwd_plan = bwd.partition(bwd_cap, stages)[::-1]  # execution order: last layers first
        # Layer grain recomputes the fused stage too (layer by layer, from inputs it keeps on the
        # device): a larger one would save nothing and hold more inputs.
        grown = None if recompute_grain == "layer" or bound is not None else _grow_fused(
            fwd, bwd, bwd_bytes, bwd_plan[0].start, limit=int(limit_gib * GIB), cap=cap, min_stages=stages,
            shared=shared_with_grads, bwd_cap=bwd_cap,
        )  # fmt: skip
        if grown is not None:
            return grown
        fused_start = bwd_plan[0].start
        fwd_plan = fwd.first(fused_start).partition(cap, min(stages, fused_start)) if fused_start else []
        return cls(fwd_plan=fwd_plan, bwd_plan=bwd_plan)


def _grow_fused(
    fwd: _Costs,
    bwd: _Costs,
    resident: Sequence[int],
    start: int,
    *,
    limit: int,
    cap: int,
    min_stages: int,
    shared: Sequence[tuple[frozenset[int], int]] = (),
    bwd_cap: int | None = None,
) -> ModelExecutePlan | None:
    """The plan with the largest fused stage that fits `limit` beside its neighbours, if larger than `start`.

    The fused stage's layers run forward, loss and backward in one residency, so they skip
    the backward recompute that every other stage pays (about a third more compute). It may
    therefore take more than half of the limit: what must fit beside it is only what is
    resident at the same time, the next backward stage's prefetched weights and gradient
    accumulators while it computes, and the last forward stage (computing) while its own
    weights and accumulators are prefetched. The other stages are partitioned under what is
    left (at most half the limit), so a larger fused stage can mean more, smaller stages
    before it, never more recompute. A whole model that fits is one stage. `min_stages`
    still holds. `resident`: per layer, the weight and accumulator bytes a prefetched
    backward stage holds; `shared`: parameters several layers use, counted in each of them
    by `resident`, held once by the fused stage; `bwd_cap`: the most a backward stage after the
    fused one may hold (default `cap`). None when no fused stage larger than the balanced plan's
    (starting at `start`) fits.
    """
    for first in range(max(0, min_stages - 1), start):
        twice = sum(
            n * (len([i for i in layers if i >= first]) - 1) for layers, n in shared if max(layers) >= first
        )
        fused_cost = sum(bwd.sizes[first:]) + max(bwd.peaks[first:]) - twice
        fused_weights = sum(resident[first:]) - twice
        if first == 0:
            if fused_cost <= limit:
                return ModelExecutePlan(fwd_plan=[], bwd_plan=[range(0, len(bwd.sizes))])
            continue
        rest_cap = min(cap if bwd_cap is None else bwd_cap, limit - fused_cost)
        fwd_cap = min(cap, limit - fused_weights)
        if rest_cap < max(resident[:first]) or fwd_cap < fwd.first(first).largest():
            continue
        rest = bwd.first(first).partition(rest_cap, min_stages - 1)
        fwd_plan = fwd.first(first).partition(fwd_cap, min(min_stages, first))
        last_fwd = fwd_plan[-1]
        last_fwd_cost = sum(fwd.sizes[i] for i in last_fwd) + max(fwd.peaks[i] for i in last_fwd)
        if sum(resident[i] for i in rest[-1]) <= rest_cap and last_fwd_cost <= fwd_cap:
            return ModelExecutePlan(fwd_plan=fwd_plan, bwd_plan=[range(first, len(bwd.sizes)), *rest[::-1]])
    return None


def layer_costs(
    model: PlannableModel, tokens_per_microbatch: int | None, recompute_grain: str
) -> tuple[_Costs, _Costs, list[int]]:
    """Forward and backward stage costs per layer, and per layer the weight + gradient bytes."""
    fwd_bytes = model.layer_bytes(with_grads=False)
    kept, transient = _activations(model, tokens_per_microbatch, len(fwd_bytes))
    fwd = _Costs(fwd_bytes, kept)  # no graph in forward: one layer's intermediates at a time
    bwd_bytes = model.layer_bytes(with_grads=True)
    if recompute_grain == "stage":
        bwd = _Costs([w + k for w, k in zip(bwd_bytes, kept)], transient)
    else:
        bwd = _Costs(bwd_bytes, [k + t for k, t in zip(kept, transient)])
    return fwd, bwd, bwd_bytes


def stage_bound(upper_threshold: float, fwd: _Costs, bwd: _Costs, run_type: str) -> int:
    """`upper_threshold` times the costliest layer (forward only for "infer"): the most a stage may cost."""
    if not upper_threshold >= 1:
        raise ValueError(
            f"upper_threshold={upper_threshold} must be >= 1: a stage holds at least one layer, and the bound is "
            "a multiple of the costliest layer (1.1 allows stages 10% above it)"
        )
    largest = fwd.largest() if run_type == "infer" else max(fwd.largest(), bwd.largest())
    return int(upper_threshold * largest)


class _Costs:
    """Per-layer bytes of one stage kind: `sizes` add up over a stage, `peaks` count once (the largest)."""

    def __init__(self, sizes: Sequence[int], peaks: Sequence[int]) -> None:
        self.sizes, self.peaks = list(sizes), list(peaks)

    def first(self, num_layers: int) -> _Costs:
        return _Costs(self.sizes[:num_layers], self.peaks[:num_layers])

    def largest(self) -> int:
        return max((s + p for s, p in zip(self.sizes, self.peaks)), default=0)

    def partition(self, cap: int, min_parts: int) -> list[range]:
        return balanced_partition(self.sizes, cap, min_parts, peaks=self.peaks)


def _activations(
    model: PlannableModel, num_tokens: int | None, num_layers: int
) -> tuple[list[int], list[int]]:
    """(kept, transient) activation bytes per layer; zeros without a token count or an estimate."""
    estimate = getattr(model, "layer_activation_bytes", None)
    if num_tokens is None or estimate is None:
        return [0] * num_layers, [0] * num_layers
    if num_tokens < 1:
        raise ValueError(f"tokens_per_microbatch={num_tokens} must be >= 1 (or None to count weights only)")
    pairs = estimate(num_tokens)
    if len(pairs) != num_layers:
        raise RuntimeError(f"layer_activation_bytes returned {len(pairs)} entries for {num_layers} layers")
    return [k for k, _ in pairs], [t for _, t in pairs]


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


def balanced_partition(
    sizes: Sequence[int], cap: int, min_parts: int, *, peaks: Sequence[int] | None = None
) -> list[range]:
    """Contiguous ranges over `sizes`, each within `cap` when possible, as balanced as their count allows.

    A range costs the sum of its `sizes` plus the largest of its `peaks` (default: none), i.e.
    memory that adds up over a stage's layers plus memory one layer at a time needs. The
    count is the larger of `min_parts` (at most one part per item) and the fewest parts that
    fit the cap; the costliest part is then minimised by a binary search over thresholds.
    """
    n = len(sizes)
    if n == 0:
        return []
    peaks = [0] * n if peaks is None else list(peaks)
    largest = max(s + p for s, p in zip(sizes, peaks))
    needed = len(_greedy(sizes, peaks, max(cap, largest)))
    parts = min(n, max(min_parts, needed))
    lo, hi = largest, max(sum(sizes) + max(peaks), largest)
    while lo < hi:  # smallest threshold that yields <= parts groups
        mid = (lo + hi) // 2
        if len(_greedy(sizes, peaks, mid)) <= parts:
            hi = mid
        else:
            lo = mid + 1
    return _split(sizes, peaks, lo, parts)


def _greedy(sizes: Sequence[int], peaks: Sequence[int], threshold: int) -> list[range]:
    """Left to right, a new range whenever the next item would push the current one past `threshold`.

    The fewest ranges possible: a range's cost never drops when it grows.
    """
    ranges: list[range] = []
    start, total, peak = 0, 0, 0
    for i, (s, p) in enumerate(zip(sizes, peaks)):
        if i > start and total + s + max(peak, p) > threshold:
            ranges.append(range(start, i))
            start, total, peak = i, 0, 0
        total, peak = total + s, max(peak, p)
    ranges.append(range(start, len(sizes)))
    return ranges


def _split(sizes: Sequence[int], peaks: Sequence[int], threshold: int, parts: int) -> list[range]:
    """Greedy split under `threshold`, then halve the costliest ranges until there are `parts`."""
    ranges = _greedy(sizes, peaks, threshold)

    def cost(r: range) -> int:
        return sum(sizes[j] for j in r) + max(peaks[j] for j in r)

    while len(ranges) < parts:
        k = max((i for i, r in enumerate(ranges) if len(r) > 1), key=lambda i: cost(ranges[i]))
        r = ranges[k]
        mid = r.start + len(r) // 2
        ranges[k : k + 1] = [range(r.start, mid), range(mid, r.stop)]
    return ranges


def _warn_if_oversized(costs: _Costs, cap: int, limit_gib: float, num_tokens: int | None) -> None:
    largest = costs.largest()
    if largest > cap:
        need = 2 * largest / GIB
        what = "weights" if num_tokens is None else f"weights and activations of {num_tokens} tokens"
        fixes = [f"raise model_memory_limit to >= {need:.3g} GiB"]
        if num_tokens is not None:
            fixes += [
                "use fewer tokens per micro-batch (raise num_microbatch) or recompute_grain='layer'",
                "set actor.tiled_mlp_tokens (long sequences: MLPs over token tiles, RMSNorms without fp32 copies)",
            ]
        fixes.append("split that layer")
        warnings.warn(
            f"the largest layer needs {largest / GIB:.3g} GiB ({what}), more than half of model_memory_limit="
            f"{limit_gib} GiB; it gets a stage of its own. To fix: {'; '.join(fixes)}",
            stacklevel=3,
        )


def default_memory_limit_gib(devices: Sequence[torch.device]) -> float:
    """60% of the smallest device's memory (host RAM when the device is the CPU).

    A GPU's memory is what this process may allocate: its total memory times the fraction set
    with `torch.cuda.set_per_process_memory_fraction` (where torch can report it).
    """
    totals = []
    for d in devices:
        if d.type == "cuda":
            fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
            share = fraction(d) if fraction is not None else 1.0
            totals.append(int(torch.cuda.get_device_properties(d).total_memory * share))
        else:
            totals.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return DEFAULT_MEMORY_FRACTION * min(totals) / GIB


def device_peak_bytes(
    plan: ModelExecutePlan, model: PlannableModel, *, tokens_per_microbatch: int | None, recompute_grain: str
) -> int:
    """Predicted device peak of one training step of `plan` (run type "fused"), from the costs it was made from.

    Two stages are resident at once: the one computing and the next one being prefetched. In
    forward the computing stage holds its weights and one layer's activations, the prefetched
    one its weights. In backward the computing stage holds its weights, the activations
    `recompute_grain` keeps, the largest transient, and the gradients of one layer (each layer's
    gradients leave for the host as its backward ends); the prefetched stage holds its weights
    and gradient accumulators. The fused stage counts as the first backward stage, and the last
    forward stage prefetches it. Inputs in flight between stages are left out. Checked against
    measured peaks on an H200 (`benchmarks/plan_accuracy.py`, `benchmarks/RESULTS.md`).
    """
    fwd, bwd, resident = layer_costs(model, tokens_per_microbatch, recompute_grain)
    weights = model.layer_bytes(with_grads=False)
    grads = [r - w for r, w in zip(resident, weights)]

    def cost(costs: _Costs, stage: range) -> int:
        return sum(costs.sizes[i] for i in stage) + max(costs.peaks[i] for i in stage)

    peak = 0
    fwd_stages, bwd_stages = list(plan.fwd_plan), list(plan.bwd_plan)
    for i, stage in enumerate(fwd_stages):
        upcoming = (
            fwd_stages[i + 1] if i + 1 < len(fwd_stages) else (bwd_stages[0] if bwd_stages else range(0))
        )
        peak = max(peak, cost(fwd, stage) + sum(weights[j] for j in upcoming))
    for i, stage in enumerate(bwd_stages):
        upcoming = bwd_stages[i + 1] if i + 1 < len(bwd_stages) else range(0)
        computing = cost(bwd, stage) - sum(grads[j] for j in stage) + max(grads[j] for j in stage)
        peak = max(peak, computing + sum(resident[j] for j in upcoming))
    return peak
