"""The device pool: every device takes the next stage task as soon as it is free.

Tasks sit in one queue in execution order. One worker thread per device queues a task's
work, then takes the next task and queues that task's weight upload on its `weights`
stream: while stage k computes, stage k+1's weights cross the bus (double buffering; hence
two stages' weights per device in the memory budget). Before allocating stage k+1, the
worker waits until stage k-1 has finished on the device, so a host running far ahead of
the GPU never piles up more than two stages of device memory. If stage k+1's weights are
still being rewritten by the host optimizer, the worker waits for that, with stage k queued.

Deadlock freedom: a task only waits on tasks earlier in the queue, and every earlier task
is running or queued on a worker, so the earliest unfinished task always makes progress.
With one device the pool degenerates to "run the tasks in order, prefetching one ahead", and
the prefetch starts earlier: at the start of stage k's last micro-batch rather than after its
whole work is queued (`_prepare_early`). A host that runs barely ahead of the device would
otherwise queue stage k+1's uploads just as the device finishes stage k, and the device would
wait for them. (With several workers the next task's device is not known that early.)

A failure in any worker sets the run's `failed` flag; the others stop at their next wait
and the first error is re-raised in the caller's thread.
"""

from __future__ import annotations

import functools
import threading
from collections import deque

from laden.engine.roundpipe import passes
from laden.engine.roundpipe.call import Run, StageTask
from laden.engine.roundpipe.device import Event, Lane, wait_host
from laden.engine.roundpipe.residency import Residency
from laden.engine.roundpipe.transfer import Aborted


class _Queue:
    def __init__(self, tasks: list[StageTask]) -> None:
        self._tasks = deque(tasks)
        self._lock = threading.Lock()

    def take(self) -> StageTask | None:
        with self._lock:
            return self._tasks.popleft() if self._tasks else None

    def peek(self) -> StageTask | None:
        with self._lock:
            return self._tasks[0] if self._tasks else None


def run_tasks(run: Run, lanes: list[Lane]) -> None:
    """Execute `run.tasks` on the pool `lanes`; returns when all are done (re-raises a failure)."""
    queue = _Queue(run.tasks)
    errors: list[BaseException] = []
    workers = [
        threading.Thread(target=_worker, args=(run, lane, queue, errors), daemon=True) for lane in lanes
    ]
    if len(workers) == 1:
        _worker(run, lanes[0], queue, errors, sole=True)  # no thread hop for a single device
    else:
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    real = [e for e in errors if not isinstance(e, Aborted)]
    if real or errors:
        raise (real or errors)[0]
    if run.aborted():
        raise Aborted  # a host job failed: the caller re-raises its error


def _worker(run: Run, lane: Lane, queue: _Queue, errors: list[BaseException], *, sole: bool = False) -> None:
    try:
        with lane.thread_context():
            current = queue.take()
            res = passes.prepare(current, lane) if current else None
            previous_done: tuple[Event, Event] = (None, None)  # the previous stage's compute, downloads
            while current is not None and not run.aborted():
                early: list[tuple[StageTask, Residency]] = []
                if sole:  # the only worker: the next task is this lane's
                    current.early = functools.partial(_prepare_early, lane, queue, previous_done, early)
                passes.execute(current, lane, res)  # type: ignore[arg-type]  # queues the stage's work
                current.early = None
                done = lane.record(lane.compute), lane.record(lane.d2h)
                nxt: StageTask | None
                nxt_res: Residency | None
                if early:
                    nxt, nxt_res = early[0]
                else:
                    nxt = queue.take()
                    nxt_res = None
                    if nxt is not None:
                        # Deliberate sync, with `current` still queued on the device: the stage before
                        # it has finished, so its memory is free again before the next weights are
                        # allocated (at most two stages resident however far the host runs ahead).
                        wait_host(previous_done[0])
                        nxt_res = passes.prepare(nxt, lane)
                previous_done = done
                current, res = nxt, nxt_res
    except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
        errors.append(e)
        run.failed.set()


def _prepare_early(
    lane: Lane, queue: _Queue, previous_done: tuple[Event, Event], early: list[tuple[StageTask, Residency]]
) -> None:
    """Stage k's last micro-batch is about to be queued: prepare stage k+1 now (its weights and first
    inputs), if that blocks nothing and holds no more device memory than preparing it afterwards:
    stage k-1 has finished on the device, its gradient downloads too (its weights and accumulators
    are free), and the host has written stage k+1's weights. Else the worker prepares it after
    queueing stage k, as before."""
    nxt = queue.peek()
    if nxt is None or not all(map(lane.finished, previous_done)) or not nxt.weights_ready():
        return
    queue.take()
    early.append((nxt, passes.prepare(nxt, lane)))
