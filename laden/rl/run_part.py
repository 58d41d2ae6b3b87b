"""The base of the parts a `laden rl` run is made of (`laden.rl.trainer._Run` and its producer, held-out
evaluation, policy step, weight sync and data-rank parts): the state they share is set up by `_Run`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any


class RunPart:
    """A part of `laden.rl.trainer._Run`: its methods read and set the run's state (`cfg`, `rt`, `engine`,
    `rollout`, ...) that `_Run.__init__` and `_Run.main` set up."""

    _kv_stays: bool | None
    """`native.free_kv_while_training: auto`'s decision, made after the first step (None before)."""
    _carry: list[int]
    """Prompts drawn for a refill and not used yet (part of the data position)."""
    _last_accuracy: float | None
    """The newest held-out accuracy (None before the first evaluation)."""

    if TYPE_CHECKING:  # the run's other state, typed where `_Run` sets it

        def __getattr__(self, name: str) -> Any: ...
