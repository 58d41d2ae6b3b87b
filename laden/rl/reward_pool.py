"""`RewardPool`: scores rewards in worker processes, so a slow, crashing or hanging reward
cannot stall or kill the trainer.

Design decisions and what they cost:
- Workers are `spawn`ed, never forked: forking a process that runs torch's thread pools (or
  CUDA) can deadlock the child. A fresh worker costs an interpreter start plus its imports
  (the pool's modules import only the standard library; the reward module's imports are the
  rest), paid at start-up and again for every replacement.
- The trainer never imports the reward module; the workers do, and each reports "ready" with
  what it found (`RewardInfo`: names, styles, the data fields the signatures require).
  `wait_ready()` turns an import that fails, one still running after `import_timeout_s` (a
  module that starts a server or waits on `input()`; its worker is killed) and a signature that
  fits no style into one `RewardSetupError` at start-up, instead of a run that scores zeros.
- A call that runs past `timeout_s` gets its worker killed (its whole process group, so
  subprocesses the reward started die with it) and replaced (`laden.rl.reward_dispatch`).
- A failed call (exception, timeout, worker death, a result that is not a finite number: a
  `str` such as "1.0" and a `bool` are failures, never coerced; numpy and torch scalars
  convert) is counted in `stats`, logged once per kind with its error text, and scored
  `error_value` (`on_error="zero"`) or raised to the caller as `RewardError`
  (`on_error="raise"`). `score_outcome` returns it as a `RewardOutcome` with the error text
  and each function's part instead, whatever `on_error` says.
- Arguments are pickled in the caller's thread, so an unpicklable field fails right there.
- A worker is recycled (killed while idle, after it answered, and replaced) once it has served
  `max_calls_per_worker` calls, when its resident memory after a call passes `max_rss_gb`, or
  when a call raised `MemoryError` (a process that ran out of memory may fail every later call).
  The worker reports its own resident memory (VmRSS) with each answer, so the reading is the one
  after that call, never one taken while it runs the next. A reward that leaks is bounded at the
  cost of one interpreter start and import per recycle (counted in `stats.worker_recycles`);
  memory allocated *within* one call is not bounded (only `timeout_s` stops a call).

How rewards are called lives in `laden.rl.reward_styles`, the built-ins in `laden.rl.rewards`,
the dispatcher thread in `laden.rl.reward_dispatch`, the worker process in `laden.rl.reward_worker`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import pickle
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from laden.rl.reward_dispatch import (
    Dispatcher,
    OnError,
    Recycle,
    RewardError,
    RewardOutcome,
    RewardPoolStats,
    RewardTimeoutError,
)
from laden.rl.reward_styles import RewardInfo, RewardSpec, as_specs, metric_names

__all__ = ["RewardError", "RewardOutcome", "RewardPool", "RewardPoolStats", "RewardTimeoutError"]


class RewardPool:
    """Scores rewards in `num_workers` spawned processes, each call bounded by `timeout_s`.

    `reward` is an import path (one function, style auto, weight 1) or a list of `RewardSpec`.
    `await pool.score(**kwargs)` and `pool.score_many([kwargs, ...])` return floats; a failed
    call scores `error_value` (`on_error="zero"`) or raises `RewardError` (`on_error="raise"`)
    and is counted in `pool.stats`. `await pool.score_outcome(**kwargs)` returns a
    `RewardOutcome` (the total, each function's part, the error text) and never raises for a
    failed call. `pool.wait_ready()` reports, at start-up, a reward that cannot load. Use as a
    context manager or call `close()`.

    `max_calls_per_worker` and `max_rss_gb` (GiB of resident memory after a call) bound a reward
    that leaks: the worker past either is replaced once it has answered (None: no bound).

    The reward modules must be importable in a fresh interpreter (workers are spawned with the
    trainer's `sys.path` and working directory), and a script that makes a pool needs the
    `if __name__ == "__main__":` guard, since spawned workers import the main module.
    """

    def __init__(
        self,
        reward: str | Sequence[RewardSpec],
        *,
        num_workers: int = 4,
        timeout_s: float = 30.0,
        on_error: OnError = "zero",
        error_value: float = 0.0,
        import_timeout_s: float = 120.0,
        max_calls_per_worker: int | None = 10000,
        max_rss_gb: float | None = 4.0,
    ) -> None:
        _check_pool_args(num_workers, timeout_s, on_error, error_value, import_timeout_s)
        _check_recycle_args(max_calls_per_worker, max_rss_gb)
        self.specs = as_specs(reward)  # checks the import paths' form; importing is the workers' job
        self.names = metric_names(self.specs)  # what `RewardOutcome.parts` is keyed by, in spec order
        self.import_timeout_s = float(import_timeout_s)
        self._dispatcher = Dispatcher(
            self.specs, self.names, num_workers=num_workers, timeout_s=float(timeout_s),
            import_timeout_s=self.import_timeout_s, on_error=on_error, error_value=float(error_value),
            recycle=Recycle(
                max_calls=max_calls_per_worker,
                max_rss_bytes=None if max_rss_gb is None else int(max_rss_gb * 2**30),
            ),
        )  # fmt: skip
        self._finalizer = weakref.finalize(self, self._dispatcher.close)

    def wait_ready(self, timeout_s: float | None = None) -> RewardInfo:
        """Block until a worker has loaded the reward(s), and return what it found.

        Raises `RewardSetupError` (a `ValueError`) naming the reward and why: its import failed
        (with the package to install for a missing module), has not finished after `timeout_s`
        (default `import_timeout_s`; the hung worker is killed), or its signature fits no style.
        The pool is closed when this raises.
        """
        ready = self._dispatcher.ready
        try:
            if timeout_s is None:
                return ready.result()  # the dispatcher enforces import_timeout_s
            try:
                return ready.result(timeout=timeout_s)
            except concurrent.futures.TimeoutError:
                self._dispatcher.abandon_start(timeout_s)
                return ready.result()
        except BaseException:
            self.close()  # joins the dispatcher: the workers are gone when this raises
            raise

    def submit(self, **kwargs: Any) -> concurrent.futures.Future[float]:
        """Queue one call; the future resolves to its reward (or `RewardError`, see `on_error`)."""
        return self._submit(kwargs, outcome=False)

    async def score(self, **kwargs: Any) -> float:
        """The reward of one call, awaited without blocking the event loop."""
        return await asyncio.wrap_future(self.submit(**kwargs))

    async def score_outcome(self, **kwargs: Any) -> RewardOutcome:
        """The outcome of one call; a failed call sets `error` (value `error_value`), never raises.

        Raises `RuntimeError` only when the pool is broken (its reward cannot load) or closed, and
        `ValueError` for arguments that cannot be pickled."""
        return await asyncio.wrap_future(self._submit(kwargs, outcome=True))

    def score_many(self, calls: Iterable[Mapping[str, Any]]) -> list[float]:
        """Rewards for many calls, in order; runs them on all workers and blocks until done."""
        futures = [self.submit(**call) for call in calls]
        concurrent.futures.wait(futures)
        return [future.result() for future in futures]

    @property
    def stats(self) -> RewardPoolStats:
        """Calls, errors, timeouts, worker restarts and recycles so far."""
        return self._dispatcher.snapshot()

    def close(self) -> None:
        """Stop the workers; calls not yet scored fail with `RuntimeError`. Idempotent."""
        self._finalizer()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _submit(self, kwargs: dict[str, Any], *, outcome: bool) -> concurrent.futures.Future[Any]:
        try:
            payload = pickle.dumps(kwargs, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise ValueError(
                f"reward arguments must be picklable to reach the worker processes: {exc}"
            ) from exc
        return self._dispatcher.submit(payload, outcome)


def _check_pool_args(
    num_workers: int, timeout_s: float, on_error: str, error_value: float, import_timeout_s: float
) -> None:
    problems = []
    if not isinstance(num_workers, int) or num_workers < 1:
        problems.append(f"num_workers={num_workers!r} must be an integer >= 1")
    if not timeout_s > 0:
        problems.append(f"timeout_s={timeout_s!r} must be > 0 seconds")
    if on_error not in ("zero", "raise"):
        problems.append(
            f"on_error={on_error!r} must be 'zero' (score error_value) or 'raise' (raise RewardError)"
        )
    if not math.isfinite(error_value):
        problems.append(f"error_value={error_value!r} must be a finite float")
    if not import_timeout_s > 0:
        problems.append(f"import_timeout_s={import_timeout_s!r} must be > 0 seconds")
    if problems:
        raise ValueError("invalid RewardPool settings: " + "; ".join(problems))


def _check_recycle_args(max_calls_per_worker: int | None, max_rss_gb: float | None) -> None:
    problems = []
    calls = max_calls_per_worker
    if calls is not None and (isinstance(calls, bool) or not isinstance(calls, int) or calls < 1):
        problems.append(
            f"max_calls_per_worker={calls!r} must be an integer >= 1 (reward_worker_max_calls), or None "
            "for no bound"
        )
    if max_rss_gb is not None and not (isinstance(max_rss_gb, int | float) and 0 < max_rss_gb < math.inf):
        problems.append(
            f"max_rss_gb={max_rss_gb!r} must be a number of GiB > 0 (reward_worker_max_rss_gb), e.g. 4, or "
            "None for no bound"
        )
    if problems:
        raise ValueError("invalid RewardPool settings: " + "; ".join(problems))
