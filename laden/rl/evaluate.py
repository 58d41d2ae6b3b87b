"""Held-out evaluation of a policy: generate for every held-out prompt, score with the training reward.

One code path serves `laden rl` (during the run, as `evaluator` says, on the rollout engine that holds
the current weights) and `laden eval` (a saved model or checkpoint, outside a run), so a before/after
comparison and the curve of a run measure the same thing. Each held-out row goes through the run's
workflow with the evaluation's sampling (`eval_gconfig`; by default greedy, one completion per prompt)
and the run's reward; nothing generated here reaches the trainer.

Metrics (`eval/...`): `accuracy`, the share of completions whose reward is at least 1 (the training
`accuracy`'s rule; over all `n` completions of each prompt, mean@n); `pass@n` for `n > 1`, the share of
prompts with at least one such completion; `reward_mean`; `response_length` (tokens); `completions`
and `prompts` counted; `reward_errors`, the completions whose reward failed (scored 0); and
`reward/<name>` per reward function when there are several.

Under torchrun each process evaluates its share of the rows (`rows[rank::world]`) on its own engine,
and the shares are gathered, so every rank returns the same metrics.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from laden.rollout.base import RolloutEngine, SamplingParams


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalSample:
    """One scored held-out completion."""

    row: int
    """Index of its row in the held-out records."""
    sample: int
    """Which of the row's `n_samples` completions it is."""
    completion_ids: tuple[int, ...]
    reward: float
    error: str | None = None
    """The reward's failure, when it failed (the reward is then the pool's error value)."""
    parts: dict[str, float] = field(default_factory=dict)
    """Each reward function's reward, by name."""
    versions: frozenset[int] = frozenset()
    """The weight versions that generated it."""


@dataclass(kw_only=True, slots=True)
class EvalResult:
    """The metrics of one evaluation and the completions they were computed from, in row order."""

    metrics: dict[str, float]
    samples: list[EvalSample]

    @property
    def first_error(self) -> str | None:
        """The first failed reward's text, in row order."""
        return next((s.error for s in self.samples if s.error is not None), None)


def eval_sampling(gconfig: Any, eval_gconfig: Any) -> tuple[SamplingParams, int]:
    """The evaluation's sampling and completions per prompt: `eval_gconfig` when set, else greedy with one
    completion per prompt and `gconfig`'s lengths and stops."""
    if eval_gconfig is not None:
        return SamplingParams.from_config(eval_gconfig), eval_gconfig.n_samples
    return replace(SamplingParams.from_config(gconfig), greedy=True, temperature=1.0, top_p=1.0, top_k=0), 1


async def evaluate(
    engine: RolloutEngine,
    records: Sequence[dict[str, Any]],
    workflow: Any,
    *,
    rank: int = 0,
    world_size: int = 1,
    gather: Callable[[Any], list[Any]] | None = None,
    rows: Sequence[int] | None = None,
) -> EvalResult:
    """Run `workflow.arun_episode` on this process's share of `records` with `engine`; gathered metrics.

    `workflow` is built with the evaluation's sampling and `n_samples` and without dynamic sampling
    (`laden.rl.workflow.load_workflow`); `gather(obj)` returns every rank's `obj` in rank order (required
    when `world_size > 1`); `rows`: the indices of `records` this process completes (default every
    `world_size`-th from `rank`).
    """
    mine = list(range(rank, len(records), world_size) if rows is None else rows)
    episodes = await asyncio.gather(*(workflow.arun_episode(engine, dict(records[i])) for i in mine))
    samples = [
        EvalSample(
            row=i, sample=t.sample_index, completion_ids=tuple(t.completion_ids), reward=float(t.reward),
            error=t.info.get("reward_error"), parts=dict(t.info.get("reward_parts") or {}),
            versions=frozenset(t.model_versions),
        )
        for i, trajs in zip(mine, episodes)
        for t in trajs or ()
    ]  # fmt: skip
    if world_size > 1:
        assert gather is not None, "evaluate under several processes needs gather"
        samples = [s for part in gather(samples) for s in part]
    samples.sort(key=lambda s: (s.row, s.sample))
    return EvalResult(metrics=eval_metrics(samples, num_prompts=len(records)), samples=samples)


def eval_metrics(samples: Sequence[EvalSample], *, num_prompts: int) -> dict[str, float]:
    """The `eval/...` metrics of scored completions (see the module docstring)."""
    n = len(samples)
    correct = [s.reward >= 1 for s in samples]
    metrics = {
        "eval/accuracy": _mean(correct),
        "eval/reward_mean": _mean([s.reward for s in samples]),
        "eval/response_length": _mean([len(s.completion_ids) for s in samples]),
        "eval/completions": float(n),
        "eval/prompts": float(num_prompts),
        "eval/reward_errors": float(sum(s.error is not None for s in samples)),
    }
    per_row: dict[int, list[bool]] = {}
    for s, ok in zip(samples, correct):
        per_row.setdefault(s.row, []).append(ok)
    k = max((len(v) for v in per_row.values()), default=1)
    if k > 1:
        metrics[f"eval/pass@{k}"] = _mean([any(v) for v in per_row.values()])
    names = dict.fromkeys(name for s in samples for name in s.parts)
    if len(names) > 1:
        for name in names:
            values = [s.parts[name] for s in samples if name in s.parts and not math.isnan(s.parts[name])]
            metrics[f"eval/reward/{name}"] = _mean(values)
    return metrics


def _mean(values: Sequence[float | bool | int]) -> float:
    return float(sum(values)) / len(values) if values else math.nan
