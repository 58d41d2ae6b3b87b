"""The two host threads of a RoundPipe model: gradient landings and optimizer updates.

`landing` takes every gradient copy as it is queued: it waits for the copy's event,
applies staged additions into the inbox, and (engine) notices when a parameter group's
gradient is complete. `optim` runs what reads or writes master weights: the user's
`step(fn)`, the engine's per-group updates, refreshing the upload copies. Both are
single-thread executors, so jobs run in submission order; the heavy tensor work inside
them (torch CPU ops, the C++ Adam kernel) releases the GIL and overlaps the main thread
feeding the GPU.

Two threads instead of one keep a long optimizer step from delaying the landings of the
next step's gradients (which the next `forward_backward` waits for before returning).
Errors are kept and re-raised at every later call into the model. A call does not rely
on having seen a failure by the time it looks: it waits, before it returns, for the result
of every optimizer job queued before it started (`last_optim` / `wait_for`), so a failed
update is reported by the very next call whatever the timing, including an asynchronous
step whose next call reads the other upload buffer and never waits for the update's weights.
That wait costs nothing in the steady state: the update ran during the call, and the
following call reads what it wrote. `busy_s` counts the seconds each thread spent in jobs
(what bounds a step when the host is the bottleneck).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any


def _shutdown(*executors: ThreadPoolExecutor) -> None:
    for executor in executors:
        executor.shutdown(wait=False)


class HostJobs:
    """Landing and optimizer executors (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self.landing = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-landing")
        self.optim = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-optim")
        self._futures: list[Future] = []
        self._last_optim: Future | None = None  # the optimizer job submitted last
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # jobs are submitted from worker and host threads too
        self.busy_s = {"landing": 0.0, "optim": 0.0}  # each written by its own thread only
        weakref.finalize(self, _shutdown, self.landing, self.optim)

    def submit_landing(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self._track(self.landing.submit(self._timed, "landing", fn, *args))

    def submit_optim(self, fn: Callable[..., Any], *args: Any) -> Future:
        # Under the lock: the landing thread submits too, and `last_optim` must be the later job.
        with self._lock:
            future = self.optim.submit(self._timed, "optim", fn, *args)
            self._futures.append(future)
            self._last_optim = future
        return future

    def last_optim(self) -> Future | None:
        """The optimizer job submitted last (None before the first): a call's `wait_for` target."""
        with self._lock:
            return self._last_optim

    def wait_for(self, future: Future | None) -> None:
        """Block until `future` and every optimizer job before it finished (one thread runs them in
        order); re-raise the first failure among them (deliberate host sync)."""
        if future is not None:
            wait([future])
        self.raise_errors()

    def _timed(self, thread: str, fn: Callable[..., Any], *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.busy_s[thread] += time.perf_counter() - start

    def _track(self, future: Future) -> Future:
        with self._lock:
            self._futures.append(future)
        return future

    def drain_landing(self) -> None:
        """Block until every landing queued so far has been applied (deliberate host sync)."""
        self.landing.submit(lambda: None).result()
        self.raise_errors()

    def drain(self) -> None:
        """Block until every host job queued so far has finished."""
        self.drain_landing()
        self.optim.submit(lambda: None).result()
        self.raise_errors()

    def failed(self) -> bool:
        """Whether a job raised (device-side waits give up then). Sticky: the model's host state
        is inconsistent after a failed update, so every later call re-raises it.

        Finished jobs are forgotten in the same pass that reads their outcome, so a job that
        fails between two looks is never dropped unseen."""
        with self._lock:
            pending = []
            for f in self._futures:
                if not f.done():
                    pending.append(f)
                elif self._error is None and f.exception() is not None:
                    self._error = f.exception()
            self._futures = pending
        return self._error is not None

    def raise_errors(self) -> None:
        """Re-raise the first failure of a host job; forget finished jobs."""
        if self.failed():
            raise RuntimeError("a roundpipe host job failed (see the chained error)") from self._error
