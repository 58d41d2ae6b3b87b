"""The trainer's side of `RewardPool`: a dispatcher thread that runs the workers, and what a call returns.

Each worker (`laden.rl.reward_worker`) owns a private pipe, and one thread hands a queued call to
one idle worker at a time, waiting on the pipes, the workers' exit sentinels and a wake-up pipe.
A call that runs past `timeout_s` gets its worker killed and replaced; nothing else is lost, since
no queue is shared between workers (a process killed while it uses a shared
`multiprocessing.Queue` can corrupt it for everyone), and `concurrent.futures`'
`ProcessPoolExecutor` cannot kill one worker (it breaks whole instead). `timeout_s` counts from
the moment a worker takes the call, and a worker takes calls only once it has imported the reward,
so start-up never times out a call.

A failed call is counted in the stats, logged once per kind (later ones at DEBUG) and settled as a
`RewardOutcome` with its error text, or as `RewardError` under `on_error="raise"`. A worker that
answered is recycled (replaced while idle) past `Recycle`'s bounds or after a `MemoryError`.
POSIX only (the dispatcher waits on file descriptors, workers use process groups).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
import traceback
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from laden.rl.reward_styles import RewardInfo, RewardSetupError, RewardSpec, describe
from laden.rl.reward_worker import Call, Worker

__all__ = [
    "Dispatcher",
    "FailureKind",
    "OnError",
    "Recycle",
    "Retirement",
    "RewardError",
    "RewardOutcome",
    "RewardPoolStats",
    "RewardTimeoutError",
]

logger = logging.getLogger(__name__)


class RewardError(RuntimeError):
    """A reward call failed (raised, died or returned a non-number); `on_error="raise"`."""


class RewardTimeoutError(RewardError):
    """A reward call ran past `timeout_s`; its worker was killed and replaced."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RewardOutcome:
    """One call's result: the weighted total, each function's part, and what went wrong."""

    value: float
    """The weighted total; `error_value` when the call failed."""
    parts: dict[str, float]
    """Each function's reward by name (NaN where it returned None or the call failed)."""
    error: str | None = None
    """The failure text (the traceback, or the timeout / worker-death message); None when scored."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RewardPoolStats:
    """Counts since the pool started (a snapshot)."""

    calls: int = 0
    """Calls finished: scored, failed or timed out."""
    errors: int = 0
    """Calls that raised, returned anything but a finite number (a str or a bool included), returned
    None from every function, or killed their worker."""
    timeouts: int = 0
    """Calls that ran past `timeout_s`."""
    worker_restarts: int = 0
    """Workers started to replace one that was killed or died."""
    worker_recycles: int = 0
    """Idle workers replaced on purpose: after `max_calls_per_worker` calls, past `max_rss_gb`, or after a
    call that raised `MemoryError`."""


OnError = Literal["zero", "raise"]
FailureKind = Literal["error", "timeout", "crash"]
Retirement = Literal["max_calls", "max_rss", "memory_error"]
_MAX_FAILED_STARTS = 3  # consecutive worker start failures before the pool gives up


@dataclass(frozen=True, slots=True, kw_only=True)
class Recycle:
    """When an idle worker is replaced on purpose (None: never for that reason)."""

    max_calls: int | None
    max_rss_bytes: int | None


class Dispatcher:
    """Owns the workers: a thread hands queued calls to idle workers and enforces timeouts.

    Kept apart from `RewardPool` so that the thread holds no reference to the pool, whose
    finalizer can then close the workers when the pool is garbage-collected.
    """

    def __init__(
        self,
        specs: Sequence[RewardSpec],
        names: list[str],
        *,
        num_workers: int,
        timeout_s: float,
        import_timeout_s: float,
        on_error: OnError,
        error_value: float,
        recycle: Recycle,
    ):
        self.specs, self.names, self.label = specs, names, describe(specs)
        self.recycle = recycle
        self.timeout_s, self.import_timeout_s = timeout_s, import_timeout_s
        self.on_error, self.error_value = on_error, error_value
        # The first ready worker's `RewardInfo`, or why none will be ready.
        self.ready: concurrent.futures.Future[RewardInfo] = concurrent.futures.Future()
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._pending: deque[Call] = deque()
        self._stats = {f.name: 0 for f in dataclasses.fields(RewardPoolStats)}
        self._logged: set[str] = set()
        self._closing = False
        self._broken: str | None = None
        self._abandon_after_s: float | None = None
        self._failed_starts = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._workers = [self._new_worker() for _ in range(num_workers)]
        self._thread = threading.Thread(target=self._run, name="laden-reward-dispatch", daemon=True)
        self._thread.start()

    # Called from any thread.

    def submit(self, payload: bytes, outcome: bool) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._broken is not None:
                raise RuntimeError(self._broken)
            if self._closing:
                raise RuntimeError("this RewardPool is closed; create a new one")
            self._pending.append(Call(future, payload, outcome))
        self._wake()
        return future

    def abandon_start(self, after_s: float) -> None:
        """`wait_ready` gave up after `after_s`: break the pool unless a worker is ready by now."""
        with self._lock:
            self._abandon_after_s = after_s
        self._wake()

    def snapshot(self) -> RewardPoolStats:
        with self._lock:
            return RewardPoolStats(**self._stats)

    def close(self) -> None:
        with self._lock:
            self._closing = True
        self._wake()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _wake(self) -> None:
        with self._lock:  # never write to a closed (and maybe reused) descriptor
            if self._wake_w < 0:
                return
            with contextlib.suppress(BlockingIOError):  # full: the thread wakes anyway
                os.write(self._wake_w, b"\0")

    # The dispatcher thread.

    def _new_worker(self) -> Worker:
        return Worker(self._context, self.specs, self.import_timeout_s)

    def _run(self) -> None:
        try:
            while not self._closing:
                self._assign()
                ready = multiprocessing.connection.wait(self._waitables(), timeout=self._next_timeout())
                if self._wake_r in ready:
                    self._drain_wake()
                for worker in list(self._workers):
                    if worker.conn in ready or worker.process.sentinel in ready:
                        self._receive(worker)
                self._expire(time.monotonic())
        except Exception:
            self._break(f"RewardPool's dispatcher failed:\n{traceback.format_exc()}")
        finally:
            self._shutdown()

    def _waitables(self) -> list[Any]:
        objects: list[Any] = [self._wake_r]
        for worker in self._workers:
            objects += [worker.conn, worker.process.sentinel]
        return objects

    def _next_timeout(self) -> float | None:
        deadlines = [w.deadline for w in self._workers if w.state != "idle"]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass

    def _assign(self) -> None:
        for worker in self._workers:
            if worker.state != "idle":
                continue
            call = self._next_call()
            if call is None:
                return
            worker.state, worker.call = "busy", call
            worker.deadline = time.monotonic() + self.timeout_s
            with contextlib.suppress(OSError):  # it died: `_receive` sees it and fails the call
                worker.conn.send_bytes(call.payload)

    def _next_call(self) -> Call | None:
        with self._lock:
            while self._pending:
                call = self._pending.popleft()
                if call.future.set_running_or_notify_cancel():
                    return call
        return None

    def _receive(self, worker: Worker) -> None:
        message: tuple[Any, ...] = ("exit", None)  # an answer ("ok", ...) carries the worker's RSS third
        with contextlib.suppress(EOFError, OSError):
            if worker.conn.poll():
                message = worker.conn.recv()
        kind, value = message[:2]
        if kind == "loading":
            if worker.state == "starting":  # the import's own bound starts now
                worker.deadline = time.monotonic() + self.import_timeout_s
            worker.state, worker.module = "loading", value
        elif kind == "ready":
            worker.state, self._failed_starts = "idle", 0
            _resolve(self.ready, value=RewardInfo(**value))
        elif kind in ("ok", "error", "memory_error"):
            self._answered(worker, kind, value, rss_bytes=message[2])
        elif kind == "fatal":
            self._break(value, setup=True)
        elif not worker.process.is_alive():
            self._on_exit(worker)

    def _on_exit(self, worker: Worker) -> None:
        code = worker.process.exitcode
        if worker.state in ("starting", "loading"):
            self._failed_starts += 1
            if self._failed_starts >= _MAX_FAILED_STARTS:
                where = f" while importing {worker.module!r}" if worker.module else ""
                self._break(
                    f"reward workers for {self.label} keep dying at start-up{where} (exit code {code})",
                    setup=True,
                )
                return
        elif worker.state == "busy":
            message = f"the reward worker for {self.label} died (exit code {code})"
            self._fail(worker, "crash", message, replace=True)
            return
        self._replace(worker)

    def _expire(self, now: float) -> None:
        if self._abandon_after_s is not None and not self.ready.done():
            self._break(self._start_timeout_message(self._abandon_after_s), setup=True)
            return
        for worker in list(self._workers):
            if worker.state == "busy" and now >= worker.deadline:
                message = (
                    f"reward function {self.label} ran past timeout_s={self.timeout_s}; its worker "
                    "was killed and replaced (raise timeout_s if the reward is legitimately this slow)"
                )
                self._fail(worker, "timeout", message, replace=True)
            elif worker.state in ("starting", "loading") and now >= worker.deadline:
                self._break(self._start_timeout_message(self.import_timeout_s), setup=True)
                return

    def _start_timeout_message(self, after_s: float) -> str:
        module = next((w.module for w in self._workers if w.state == "loading"), None)
        if module is None:
            return (
                f"a reward worker for {self.label} has not started after {after_s:g} s (a Python interpreter "
                "start and `import laden.rl.reward_worker`); the machine may be overloaded: raise import_timeout_s"
            )
        return (
            f"reward {self.label}: importing {module!r} has not finished after {after_s:g} s: does the module "
            "block at import (a server, input(), a lock)? Move that work into the reward function or under "
            "`if __name__ == '__main__':`, or raise import_timeout_s (reward_import_timeout_s) if the import "
            "is legitimately this slow; the worker was killed"
        )

    def _answered(self, worker: Worker, kind: str, value: Any, *, rss_bytes: int | None) -> None:
        """A worker answered its call ("ok", "error" or "memory_error"): recycle it if due, resolve the call."""
        worker.num_calls += 1
        retire = self._retirement(worker, memory_error=kind == "memory_error", rss_bytes=rss_bytes)
        if kind == "ok":
            total, parts = value
            self._finish(worker, RewardOutcome(value=total, parts=parts), retire=retire)
        else:
            self._fail(worker, "error", value, retire=retire)

    def _retirement(
        self, worker: Worker, *, memory_error: bool, rss_bytes: int | None
    ) -> tuple[Retirement, str] | None:
        """Why a worker that just answered is to be replaced, and the message; None to keep it."""
        limit_bytes, max_calls = self.recycle.max_rss_bytes, self.recycle.max_calls
        pid = worker.process.pid
        if memory_error:
            return "memory_error", (
                f"a call of reward {self.label} raised MemoryError; its worker (pid {pid}) was replaced, since a "
                "process that ran out of memory may fail every later call"
            )
        if limit_bytes is not None and rss_bytes is not None and rss_bytes > limit_bytes:
            return "max_rss", (
                f"the reward worker for {self.label} (pid {pid}) held {rss_bytes / 2**30:.2f} GiB after a call, "
                f"past max_rss_gb={limit_bytes / 2**30:g} (reward_worker_max_rss_gb); it was replaced. A reward "
                "that keeps memory between calls (a growing cache or list) leaks: bound it, or raise the limit "
                "if the reward legitimately needs this much"
            )
        if max_calls is not None and worker.num_calls >= max_calls:
            return "max_calls", (
                f"the reward worker for {self.label} (pid {pid}) served max_calls_per_worker={max_calls} calls "
                "(reward_worker_max_calls); it was replaced by a fresh one"
            )
        return None

    def _finish(
        self, worker: Worker, outcome: RewardOutcome, *, retire: tuple[Retirement, str] | None = None
    ) -> None:
        call = self._release(worker, replace=False, retire=retire)
        self._settle(call, outcome, None)

    def _fail(
        self,
        worker: Worker,
        kind: FailureKind,
        message: str,
        *,
        replace: bool = False,
        retire: tuple[Retirement, str] | None = None,
    ) -> None:
        """Count and log a failed call, replace or recycle its worker if asked, then resolve the
        call (in that order, so a caller who sees the outcome also sees it in `stats`)."""
        call = self._release(worker, replace=replace, retire=retire)
        self._log_once(kind, message)
        parts = dict.fromkeys(self.names, math.nan)
        self._settle(call, RewardOutcome(value=self.error_value, parts=parts, error=message), kind)

    def _settle(self, call: Call | None, outcome: RewardOutcome, kind: FailureKind | None) -> None:
        with self._lock:
            self._stats["calls"] += 1
            if kind is not None:
                self._stats["timeouts" if kind == "timeout" else "errors"] += 1
        assert call is not None, "a worker answered a call it was not given"
        if call.outcome:
            _resolve(call.future, value=outcome)
        elif kind is not None and self.on_error == "raise":
            error_type = RewardTimeoutError if kind == "timeout" else RewardError
            _resolve(call.future, error=error_type(outcome.error))
        else:
            _resolve(call.future, value=outcome.value)

    def _log_once(self, kind: str, message: str) -> None:
        if kind in self._logged:
            logger.debug("%s", message)
            return
        self._logged.add(kind)
        logger.warning(
            "%s\n(scored %s; counted in RewardPool.stats; further failures of this kind log at DEBUG)",
            message,
            "as RewardError" if self.on_error == "raise" else self.error_value,
        )

    def _release(
        self, worker: Worker, *, replace: bool, retire: tuple[Retirement, str] | None
    ) -> Call | None:
        """Take the call off a worker; replace a failed one (`replace`) or recycle an idle one (`retire`)."""
        call, worker.call, worker.state = worker.call, None, "idle"
        if replace:
            self._replace(worker)
        elif retire is not None:
            self._replace(worker, counter="worker_recycles")
            reason, message = retire
            self._log_recycle(reason, message)
        return call

    def _log_recycle(self, reason: Retirement, message: str) -> None:
        key = f"recycle:{reason}"
        if key in self._logged:
            logger.debug("%s", message)
            return
        self._logged.add(key)
        level = logging.INFO if reason == "max_calls" else logging.WARNING
        logger.log(level, "%s\n(counted in RewardPool.stats.worker_recycles; further recycles for this reason "
                   "log at DEBUG)", message)  # fmt: skip

    def _replace(self, worker: Worker, *, counter: str = "worker_restarts") -> None:
        worker.kill()  # also ends what the reward left running in its process group
        self._workers[self._workers.index(worker)] = self._new_worker()
        with self._lock:
            self._stats[counter] += 1

    def _break(self, message: str, *, setup: bool = False) -> None:
        """Stop the pool for good; a start-up failure is `wait_ready`'s `RewardSetupError`."""
        logger.error("%s", message)
        with self._lock:
            self._broken, self._closing = message, True
        _resolve(self.ready, error=RewardSetupError(message) if setup else RuntimeError(message))

    def _shutdown(self) -> None:
        with self._lock:
            pending, self._pending = list(self._pending), deque()
            self._closing = True
            reason = self._broken or "the RewardPool was closed before this reward was scored"
        calls = pending + [w.call for w in self._workers if w.call is not None]
        for call in calls:
            _resolve(call.future, error=RuntimeError(reason))
        _resolve(self.ready, error=RuntimeError(reason))
        for worker in self._workers:
            worker.stop()
        with self._lock:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1


def _resolve(
    future: concurrent.futures.Future[Any], *, value: Any = None, error: BaseException | None = None
) -> None:
    """Set a future's outcome unless it is already done (cancelled by its caller, say)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
