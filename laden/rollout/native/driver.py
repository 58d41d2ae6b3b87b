"""The native engine's asyncio side: one worker thread runs all of its device work, a driver task runs
decode windows while there is work, callers take the engine's lock between windows (a waiting caller
stops chained windows, so it gets the lock within one), and results reach each caller's queue."""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from laden.rollout.base import GenerationResult


class EngineDriver:
    """The worker thread, the lock and the driver task of `NativeEngine` (a part of it; `NativeEngine.__init__`
    sets this state)."""

    core: Any
    """The engine's `GenerationCore` (scheduler and runner)."""
    tp: Any
    """This rank's tensor-parallel group, or None."""
    _executor: ThreadPoolExecutor
    _lock: asyncio.Lock | None
    _resumed: asyncio.Event | None
    _work: asyncio.Event | None
    _driver: asyncio.Task | None
    _queues: dict[str, asyncio.Queue]
    _paused: bool
    _sleeping: bool
    _closed: bool
    _waiters: int
    """Callers waiting for the lock: the core launches no chained window meanwhile."""

    def _ensure_loop_state(self) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
            self._resumed = asyncio.Event()
            self._resumed.set()
            self._work = asyncio.Event()

    async def in_worker(self, fn, *args):
        """`fn(*args)` in the engine's worker thread, where all of its device work runs (awaited)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def in_worker_now(self, fn, *args):
        """`fn(*args)` in the engine's worker thread, from synchronous code (blocks until done)."""
        return self._executor.submit(fn, *args).result()

    def _may_chain(self) -> bool:
        """Whether the core may launch a window before reading the one in flight (worker thread)."""
        return self._waiters == 0 and not (self._paused or self._sleeping or self._closed)

    @contextlib.asynccontextmanager
    async def _exclusive(self):
        """The engine's lock, for a caller other than the driver: while it waits, the window in
        flight is the last one launched, so it gets the lock within one window."""
        assert self._lock is not None
        self._waiters += 1
        try:
            await self._lock.acquire()
        finally:
            self._waiters -= 1
        try:
            yield
        finally:
            self._lock.release()

    def _deliver(self, results: list[GenerationResult]) -> None:
        for r in results:
            waiting = self._queues.get(r.rid)
            if waiting is not None:
                waiting.put_nowait(r)

    async def _flush(self) -> None:
        """Read the window in flight and hand out what finished in it (under the lock)."""
        self._deliver(await self.in_worker(self.core.drain))

    async def _drive(self) -> None:
        assert self._lock is not None and self._resumed is not None
        while not self._closed:
            await self._resumed.wait()
            async with self._lock:
                if self._paused or self._sleeping:
                    continue
                if self.core.idle:
                    await self._send("idle")  # the followers stop listening
                    return
                try:
                    results = await self.in_worker(self.core.step)
                except BaseException as e:  # noqa: BLE001 - reach every waiting caller
                    self.core.abort_all()  # nothing stays queued behind a request that cannot run
                    await self._send("error", f"{type(e).__name__}: {e}")
                    for q in set(self._queues.values()):
                        q.put_nowait(e)
                    return
                # Tensor parallel: the followers' copies of these results ride on the next message; when
                # nothing is left it is sent now, before a caller sees them (and may end the event loop).
                done = self.tp is not None and self.core.idle
                if done:
                    await self._send("idle")
            self._deliver(results)
            if done:
                return  # no await since the lock was released: no request was queued meanwhile

    async def _send(
        self, kind: str, payload: Any = None, results: list[GenerationResult] | None = None
    ) -> None:
        """Tensor parallel leader: a message to the followers, from the worker thread (ordered with the
        windows' messages). A no-op otherwise."""
        if self.tp is not None:
            await self.in_worker(self.core.send, kind, payload, results)
