"""When a run evaluates on its held-out data: `evaluator` (AReaL's section) read by both jobs.

A run evaluates after step `step` when it is the last step, or a multiple of `freq_steps`, or the end
of every `freq_epochs`-th epoch, or when `freq_secs` seconds of training passed since the last
evaluation (before training, with `eval_before_train`, is the caller's). Under several processes the
time rule reads each process's clock, so callers take rank 0's answer.
"""

from __future__ import annotations

from typing import Any


def evaluation_due(
    evaluator: Any, *, step: int, total_steps: int, steps_per_epoch: int, seconds_since_last: float
) -> bool:
    """Whether to evaluate after `step` (see the module docstring)."""
    e = evaluator
    return (
        step == total_steps
        or bool(e.freq_steps and step % e.freq_steps == 0)
        or bool(e.freq_epochs and step % (steps_per_epoch * e.freq_epochs) == 0)
        or bool(e.freq_secs and seconds_since_last >= e.freq_secs)
    )
