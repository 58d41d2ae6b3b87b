"""Plans for several models that run one after the other (`ModelExecutePlan.auto(run_type, m1, m2, ...)`).

Each model is planned by the one-model planner; what ties them together is the stage
bound: with `upper_threshold`, every stage of every model costs at most `upper_threshold`
times the costliest layer of all the models (bytes, as everywhere in laden's planner), so
the stages of the chain are alike in size. Each model's bound is handed to the one-model
planner as its own ratio (`upper_threshold * largest of all / largest of this model`).
Without `upper_threshold` the models are planned independently.

Every model gets a plan of `run_type`, as the API laden mirrors plans models it has no
timings for (and laden plans by bytes, never by timings): with `"fused"` each plan is
fused-shaped, the shape laden's `forward()` under grad mode runs too (its last forward stage
is its first backward stage). A chain's first models called through `forward()` therefore run
their plans as they are; for a `"train"`-shaped plan (forward and backward stages over all the
layers) ask for one: `ModelExecutePlan.auto("train", model1)`.
Trade-off: per-model partitions rather than one search over all of them; the bound is the
same, so the stage sizes are, but the stage counts are not minimised jointly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from laden.engine.roundpipe.plan import ModelExecutePlan, PlannableModel, RunType


def joint_plans(
    cls: type[ModelExecutePlan],
    run_type: RunType,
    models: Sequence[PlannableModel],
    *,
    min_stages: int | None,
    model_memory_limit: float | None,
    upper_threshold: float | None,
    tokens_per_microbatch: int | None,
    recompute_grain: Literal["stage", "layer"],
) -> list[ModelExecutePlan]:
    """One plan per model, in order (see the module docstring); [] for no model."""
    from laden.engine.roundpipe.plan import layer_costs

    ratios: list[float | None] = [upper_threshold] * len(models)
    if upper_threshold is not None and models:
        largest = [
            _largest_cost(layer_costs(m, tokens_per_microbatch, recompute_grain), run_type) for m in models
        ]
        top = max(largest)
        ratios = [upper_threshold * top / max(1, own) for own in largest]
    plans = []
    for model, ratio in zip(models, ratios):
        plans.append(
            cls.auto(
                run_type,
                model,
                min_stages=min_stages,
                model_memory_limit=model_memory_limit,
                upper_threshold=ratio,
                tokens_per_microbatch=tokens_per_microbatch,
                recompute_grain=recompute_grain,
            )  # fmt: skip
        )
    return plans


def _largest_cost(costs: tuple, run_type: str) -> int:
    fwd, bwd, _ = costs
    return fwd.largest() if run_type == "infer" else max(fwd.largest(), bwd.largest())
