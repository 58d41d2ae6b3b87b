"""One reward worker: the process that imports the reward and scores calls, and its handle in the trainer.

The handle (`Worker`) spawns the process with a private pipe, tracks its state and the call it
runs, and kills its whole process group. The process (`_worker_main`) leads its own process group
(so a kill also ends the subprocesses a reward started), exits when the trainer dies (so a hung
reward never outlives a killed trainer), imports the reward, says "ready" with what it found
(`RewardInfo`), then answers one call at a time. It speaks one protocol over the pipe, the
messages "loading", "ready", "ok", "error", "memory_error" and "fatal"; each answer carries the
process's resident memory after the call (VmRSS), which `laden.rl.reward_dispatch` uses to
recycle a worker that leaks. Workers are spawned, so this module imports only the standard
library and the reward modules it needs (`reward_styles`, `rewards`): a fresh worker pays an
interpreter start plus the reward module's own imports.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import pickle
import resource
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from laden.rl.reward_styles import (
    CompositeReward,
    RewardCallError,
    RewardSetupError,
    RewardSpec,
    describe,
    load_rewards,
)
from laden.rl.rewards import import_builtin_needs

__all__ = ["Call", "Worker"]


@dataclass(slots=True)
class Call:
    """A queued call: its pickled arguments, and whether its future takes the whole outcome."""

    future: concurrent.futures.Future[Any]
    payload: bytes
    outcome: bool


class Worker:
    """One spawned process, its end of a private pipe, and the call it is running."""

    __slots__ = ("process", "conn", "state", "call", "deadline", "module", "num_calls")

    def __init__(self, context: Any, specs: Sequence[RewardSpec], start_timeout_s: float) -> None:
        self.conn, child_conn = context.Pipe(duplex=True)
        plain_specs = [dataclasses.asdict(spec) for spec in specs]  # plain dicts pickle on every Python
        self.process = context.Process(
            target=_worker_main, args=(child_conn, plain_specs), name="laden-reward", daemon=False
        )
        self.process.start()
        child_conn.close()
        self.state: Literal["starting", "loading", "idle", "busy"] = "starting"
        self.call: Call | None = None
        self.deadline = time.monotonic() + start_timeout_s
        self.module: str | None = None  # the reward module it is importing (state "loading")
        self.num_calls = 0  # calls it has answered

    def kill(self) -> None:
        """SIGKILL the worker's process group (the reward's own subprocesses too)."""
        # `exitcode` reaps a dead worker; only an unreaped one's pid is sure to still name its
        # group (a reaped pid may be reused by an unrelated process).
        if self.process.exitcode is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)  # type: ignore[arg-type]
            except (ProcessLookupError, PermissionError):
                self.process.kill()  # it had not made its own group yet
        self.process.join(timeout=10)
        self.conn.close()

    def stop(self) -> None:
        """Ask an idle worker to exit; kill it if it does not."""
        if self.state == "idle":
            with contextlib.suppress(OSError):
                self.conn.send_bytes(pickle.dumps(None))
                self.process.join(timeout=2)
        if self.process.is_alive():
            self.kill()
        self.conn.close()


# --- the worker process ------------------------------------------------------------------


def _worker_main(conn: multiprocessing.connection.Connection, plain_specs: list[dict[str, Any]]) -> None:
    """Load the rewards, say "ready", then answer calls until told to stop or the pipe closes."""
    with contextlib.suppress(OSError):  # else a timeout kills only the worker itself
        os.setpgid(0, 0)  # its own process group: a timeout kills the reward's subprocesses too
    parent = multiprocessing.parent_process()
    if parent is not None:  # a hung reward must not outlive a trainer that was killed
        threading.Thread(target=_exit_with, args=(parent.sentinel,), daemon=True).start()
    reward = _load_in_worker(conn, [RewardSpec(**spec) for spec in plain_specs])
    if reward is None:
        return
    conn.send(("ready", dataclasses.asdict(reward.info())))
    while True:
        try:
            kwargs = pickle.loads(conn.recv_bytes())
        except EOFError:
            return  # the trainer went away
        if kwargs is None:
            return
        conn.send((*_answer(reward, kwargs), _rss_bytes()))


def _answer(reward: CompositeReward, kwargs: dict[str, Any]) -> tuple[str, Any]:
    """One call's answer: ("ok", (total, parts)), or ("error" | "memory_error", the error text)."""
    try:
        return "ok", reward.score(kwargs)
    except Exception as exc:
        text = str(exc) if isinstance(exc, RewardCallError) else traceback.format_exc()
        return ("memory_error" if _out_of_memory(exc) else "error"), text


def _out_of_memory(exc: BaseException | None) -> bool:
    """Whether `exc` is, or was raised while handling, a `MemoryError` (`RewardCallError` wraps it)."""
    seen: set[int] = set()  # a chain can loop back on itself
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, MemoryError):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _rss_bytes() -> int:
    """This process's resident memory now (VmRSS); without /proc, its peak so far (`ru_maxrss`), which
    is never lower, so the bound still holds (it may recycle a worker that has since shrunk)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _load_in_worker(
    conn: multiprocessing.connection.Connection, specs: list[RewardSpec]
) -> CompositeReward | None:
    """The loaded rewards, or None after telling the trainer why they cannot load ("fatal")."""
    try:
        reward = load_rewards(specs, on_import=lambda module: conn.send(("loading", module)))
        for fn in reward.functions:
            import_builtin_needs(fn)
        return reward
    except RewardSetupError as exc:
        conn.send(("fatal", str(exc)))
    except BaseException as exc:  # SystemExit from a module that exits at import, too
        conn.send(
            ("fatal", f"loading the reward {describe(specs)} failed: {exc!r}\n{traceback.format_exc()}")
        )
    return None


def _exit_with(parent_sentinel: int) -> None:
    """End this worker (and its process group, when it leads one) once the trainer is gone."""
    multiprocessing.connection.wait([parent_sentinel])
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(1)
