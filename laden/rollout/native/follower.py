"""A tensor parallel follower: ranks 1..t-1 of a native engine run what the leader sends.

A follower's `NativeEngine` methods are collective calls matched one to one, in order, with the
leader's (`laden.rollout.native.tensor_parallel` says why only the leader schedules): each
method call of the leader sends one message, and the follower's call of the same method
returns once its worker thread has applied that message (a weight update with the follower's
own source, sliced to its shard; `sleep`, `wake`, `close`). Windows are not calls: the leader's
driver sends their device phases, and a follower runs them as they come, routing the finished
completions (which ride on the next message) to its own `generate` callers; a result that
comes before the follower's `generate` call for it is kept until the call.

A follower listens only while it expects a message: while a call of its own waits for one, or
while it has results to come and the leader runs (not paused, not asleep). At the leader's
halts (`idle`, `pause`, `sleep`, `error`) it stops otherwise, so no receive waits through a
training step into a gloo or NCCL timeout; the leader's next message then waits for the
follower's next call, which any later leader message has as its counterpart.

It drives its engine through the engine's public methods only: `in_worker` / `in_worker_now` (the
worker thread, where every device phase and `tp.receive` run), `core.check` and `core.follow`,
and the worker-thread halves of the calls (`apply_update`, `release_memory`, `restore_memory`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from laden.rollout.base import GenerationRequest, GenerationResult
from laden.rollout.native.tensor_parallel import Message

if TYPE_CHECKING:
    from laden.rollout.native.engine import NativeEngine


@dataclass(eq=False, slots=True)
class _Call:
    """A method call of this rank waiting for the leader's message of the same kind."""

    kind: str
    future: asyncio.Future
    source: Any = None
    version: int | None = None


class Follower:
    """The follower side of `engine` (see the module docstring)."""

    def __init__(self, engine: NativeEngine) -> None:
        self.engine = engine
        assert engine.tp is not None
        self.rank = engine.tp.rank
        self.paused = False  # the leader's state, as of the last message applied
        self.sleeping = False
        self.queues: dict[str, asyncio.Queue] = {}
        self.remaining: dict[str, int] = {}  # results still to come per request id
        self.early: dict[str, list[GenerationResult]] = {}  # results before their generate call
        self.reset()

    def reset(self) -> None:
        """Forget the event loop's objects (a new loop follows: `generate_sync`, `asyncio.run`)."""
        self.calls: deque[_Call] = deque()
        self.arrived: asyncio.Event | None = None
        self.task: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    # ----------------------------------------------------------------- the methods

    async def generate(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[GenerationResult]:
        rids = [r.rid for r in requests]
        if len(set(rids)) != len(rids) or any(rid in self.queues for rid in rids):
            raise ValueError("request ids must be unique among the requests in flight")
        for r in requests:
            self.engine.core.check(r)
        queue: asyncio.Queue = asyncio.Queue()
        for r in requests:
            self.queues[r.rid] = queue
            self.remaining[r.rid] = r.n_samples
            for result in self.early.pop(r.rid, []):
                self._deliver(result)
        if self.outstanding and not (self.paused or self.sleeping):
            self._listen()
        try:
            for _ in range(sum(r.n_samples for r in requests)):
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            for rid in rids:
                self.queues.pop(rid, None)
                self.remaining.pop(rid, None)

    async def call(self, kind: str, source: Any = None, version: int | None = None) -> None:
        """This rank's `kind` call: returns once the leader's message for it was applied here."""
        self._ensure_loop_state()
        assert self.arrived is not None
        future = asyncio.get_running_loop().create_future()
        self.calls.append(_Call(kind, future, source, version))
        self.arrived.set()
        self._listen()
        await future

    async def drain(self) -> None:
        """Wait for the listening task (the end of `generate_sync`)."""
        if self.task is not None:
            await self.task

    def load_weights_now(self, source: Any, version: int) -> None:
        """`load_weights` from synchronous code: the leader's next message must be its update."""
        if self.task is not None and not self.task.done():
            raise RuntimeError(
                "load_weights on a tensor parallel follower while the engine runs: use await update_weights(...)"
            )
        engine = self.engine
        message = engine.in_worker_now(engine.tp.receive)
        for result in message.results:
            self._deliver(result)
        self._check_kind(message, "update")
        engine.in_worker_now(self._apply, message, _Call("update", None, source, version))  # type: ignore[arg-type]

    # ----------------------------------------------------------------- listening

    @property
    def outstanding(self) -> int:
        return sum(self.remaining.values())

    def _ensure_loop_state(self) -> None:
        loop = asyncio.get_running_loop()
        if self.loop is not loop:  # an event would be bound to the previous loop
            assert self.task is None or self.task.done(), "the engine is driven from two event loops"
            self.reset()
            self.loop, self.arrived = loop, asyncio.Event()

    def _listen(self) -> None:
        self._ensure_loop_state()
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._follow())

    def _expecting(self) -> bool:
        return bool(self.calls) or (self.outstanding > 0 and not (self.paused or self.sleeping))

    async def _follow(self) -> None:
        engine = self.engine
        try:
            while True:
                message = await engine.in_worker(engine.tp.receive)
                for result in message.results:
                    self._deliver(result)
                if message.kind in ("prefill", "decode"):
                    await engine.in_worker(engine.core.follow, message)
                    continue
                if message.kind == "error":
                    self._fail(
                        RuntimeError(f"tensor parallel rank 0 failed in generation: {message.payload}")
                    )
                elif message.kind != "idle":
                    await self._answer(message)
                if message.kind == "close" or not self._expecting():
                    return
        except BaseException as e:  # noqa: BLE001 - reach every waiting caller of this rank
            self._fail(e)
            for c in self.calls:
                if not c.future.done():
                    c.future.set_exception(e)
            self.calls.clear()
            raise

    async def _answer(self, message: Message) -> None:
        """Apply a method call's message with this rank's matching call (waiting for it if needed)."""
        assert self.arrived is not None
        while not self.calls:
            self.arrived.clear()
            await self.arrived.wait()
        call = self.calls.popleft()
        try:
            self._check_kind(message, call.kind)
            await self.engine.in_worker(self._apply, message, call)
        except BaseException as e:
            call.future.set_exception(e)
            raise
        call.future.set_result(None)

    def _check_kind(self, message: Message, kind: str) -> None:
        if message.kind != kind:
            raise RuntimeError(
                f"tensor parallel rank {self.rank} called {kind!r} where rank 0 called {message.kind!r}: every rank "
                "calls the engine's methods in the same order with the same arguments"
            )

    def _apply(self, message: Message, call: _Call) -> None:
        """In the worker thread: what the leader's call did to its own rank, on this one."""
        engine, kind = self.engine, message.kind
        if kind == "update":
            if call.version != message.payload:
                raise RuntimeError(
                    f"tensor parallel rank {self.rank} updated to version {call.version}, rank 0 to "
                    f"{message.payload}: every rank passes the same version"
                )
            engine.apply_update(call.source, message.payload)
        elif kind == "sleep" and not self.sleeping:
            engine.release_memory(message.payload)
        elif kind == "wake" and self.sleeping:
            engine.restore_memory()
        self.paused = {"pause": True, "resume": False}.get(kind, self.paused)
        self.sleeping = {"sleep": True, "wake": False}.get(kind, self.sleeping)

    # ----------------------------------------------------------------- results

    def _deliver(self, result: GenerationResult) -> None:
        queue = self.queues.get(result.rid)
        if queue is None or self.remaining.get(result.rid, 0) <= 0:
            self.early.setdefault(result.rid, []).append(result)
            return
        self.remaining[result.rid] -= 1
        queue.put_nowait(result)

    def _fail(self, error: BaseException) -> None:
        for queue in set(self.queues.values()):
            queue.put_nowait(error)
        self.remaining.clear()
        self.early.clear()
