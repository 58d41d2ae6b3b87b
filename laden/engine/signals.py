"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM (what schedulers send) without losing the step in hand.

The first signal only asks: the training loop stops at the end of the step it is in, writes a
checkpoint of that step and exits with a one-line message (`RunInterrupted`, exit status 128 +
the signal). Stopping at once would leave the engine between two steps (a training step half
applied, a weight update half sent), which no checkpoint can describe. A second Ctrl-C stops at
once (`KeyboardInterrupt`), for a step that hangs; the last checkpoint is then what a rerun resumes.

Signal handlers belong to the main thread: elsewhere (a library user's worker thread) nothing is
installed and only the default behaviour applies. Under several processes every rank receives the
signal from its launcher, and the loops agree on the step to stop at (`Runtime.gather_floats`).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType
from typing import Any

from laden.errors import RunFailedError

log = logging.getLogger("laden")


class RunInterrupted(RunFailedError):
    """The run stopped at a signal after checkpointing its last finished step; `exit_status` is 128 + it."""

    def __init__(self, message: str, *, signum: int) -> None:
        super().__init__(message)
        self.exit_status = 128 + signum


class StopRequests:
    """While entered: SIGINT and SIGTERM set `signum` instead of stopping (see the module docstring)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        self.signum = signum
        log.warning(
            "%s received: stopping after the step in progress, with a checkpoint of it%s",
            signal.Signals(signum).name, " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else "",
        )  # fmt: skip

    def interrupted(self, step: int, run_dir: Any) -> RunInterrupted:
        """The error to raise once step `step` is checkpointed."""
        assert self.signum is not None
        name = signal.Signals(self.signum).name
        return RunInterrupted(
            f"{name}: stopped after step {step}, checkpointed; rerun the same command to resume from it ({run_dir})",
            signum=self.signum,
        )


def agree_to_stop_or_save(rt: Any, requested: bool, last_save_t: float, checkpoint: Any) -> tuple[bool, bool]:
    """After a step: (stop now: a signal reached any rank, save now: `checkpoint.save_every_minutes` passed
    since `last_save_t` (`now()`) by rank 0's clock), the same on every rank (one gather)."""
    minutes = checkpoint.save_every_minutes
    overdue = minutes is not None and now() - last_save_t >= 60 * minutes
    if rt.world_size == 1:
        return requested, overdue
    every = rt.gather_floats(float(requested) + 2.0 * float(overdue))
    return any(int(v) % 2 for v in every), every[0] >= 2


def now() -> float:
    """The clock of `save_every_minutes` (seconds, monotonic)."""
    return time.monotonic()
