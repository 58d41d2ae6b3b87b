"""Rewards for RL: the built-in reward functions, and `RewardPool`, which scores in worker processes.

A run names its reward as `reward_fn: "package.module:function"`, or several with weights
(`RewardSpec`s; the completion's reward is the weighted sum). laden's own convention calls the
function with keyword arguments `prompt`, `completion` (text), `prompt_ids`, `completion_ids`
(token ids) and every other field of the data row (`answer`, `metadata`, ...), and takes a float
back; functions written for AReaL, TRL or verl are called in their own convention, detected from
their signature (`laden.rl.reward_styles`, which also holds `load_reward_fn`).

Built-ins:
- `math_reward`: 1.0 when the completion's final answer equals the row's `answer`, decided
  by `math-verify` (LaTeX and plain expressions, `\\frac{1}{2}` == `0.5`); 0.0 otherwise.
- `reasoning_gym_reward`: the reasoning-gym task's own `score_answer` on the text inside the
  completion's last `<answer>...</answer>` tag.

`RewardPool` runs the reward functions in worker processes, so a slow, crashing or hanging
reward cannot stall or kill the trainer. Design decisions and what they cost:
- Workers are `spawn`ed, never forked: forking a process that runs torch's thread pools (or
  CUDA) can deadlock the child. A fresh worker costs an interpreter start plus its imports
  (this module imports only the standard library; the reward module's imports are the rest),
  paid at start-up and again for every replacement.
- The trainer never imports the reward module; the workers do, and each reports "ready" with
  what it found (`RewardInfo`: names, styles, the data fields the signatures require).
  `wait_ready()` turns an import that fails, one still running after `import_timeout_s` (a
  module that starts a server or waits on `input()`; its worker is killed) and a signature that
  fits no style into one `RewardSetupError` at start-up, instead of a run that scores zeros.
- Each worker owns a private pipe, and a dispatcher thread in the trainer hands a call to one
  idle worker at a time. A call that runs past `timeout_s` gets its worker killed (its whole
  process group, so subprocesses the reward started die with it) and replaced; nothing else
  is lost, since no queue is shared between workers (a process killed while it uses a shared
  `multiprocessing.Queue` can corrupt it for everyone). `concurrent.futures`'
  `ProcessPoolExecutor` cannot kill one worker; it breaks whole instead.
- `timeout_s` counts from the moment a worker takes the call, not time spent queued, and a
  worker takes calls only once it has imported the reward, so start-up never times out a call.
- A failed call (exception, timeout, worker death, a result that is not a finite number: a
  `str` such as "1.0" and a `bool` are failures, never coerced; numpy and torch scalars
  convert) is counted in `stats`, logged once per kind with its error text, and scored
  `error_value` (`on_error="zero"`) or raised to the caller as `RewardError`
  (`on_error="raise"`). `score_outcome` returns it as a `RewardOutcome` with the error text
  and each function's part instead, whatever `on_error` says.
- Arguments are pickled in the caller's thread, so an unpicklable field fails right there.
- A worker leads its own process group and exits when the trainer dies, so a hung reward
  never outlives a killed trainer.
- A worker is recycled (killed while idle, after it answered, and replaced) once it has served
  `max_calls_per_worker` calls, when its resident memory after a call passes `max_rss_gb`, or
  when a call raised `MemoryError` (a process that ran out of memory may fail every later call).
  The worker reports its own resident memory (VmRSS) with each answer, so the reading is the one
  after that call, never one taken while it runs the next. A reward that leaks is bounded at the
  cost of one interpreter start and import per recycle (counted in `stats.worker_recycles`);
  memory allocated *within* one call is not bounded (only `timeout_s` stops a call).

This module imports only the standard library; `math-verify` and `reasoning-gym` load in the
workers, at start-up when a built-in needs them (`pip install 'laden[rl]'`). POSIX only (the
dispatcher waits on file descriptors, workers use process groups). Past 600 lines (about 980):
the pool and its worker loop are two thirds of the file and one protocol (the messages "loading",
"ready", "ok", "error", "memory_error", "fatal"); how rewards are called lives in `reward_styles`.
The pool is the part to move to a module of its own if this one grows again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import importlib
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import re
import resource
import signal
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from laden.rl.reward_styles import (
    RAW_PROMPT_KEY,
    STYLE_SIGNATURES,
    CompositeReward,
    RewardCallError,
    RewardFn,
    RewardInfo,
    RewardSetupError,
    RewardSpec,
    RewardStyle,
    as_specs,
    describe,
    load_reward_fn,
    load_rewards,
    metric_names,
    missing_fields,
)

__all__ = [
    "RAW_PROMPT_KEY",
    "STYLE_SIGNATURES",
    "RewardError",
    "RewardFn",
    "RewardInfo",
    "RewardOutcome",
    "RewardPool",
    "RewardPoolStats",
    "RewardSetupError",
    "RewardSpec",
    "RewardStyle",
    "RewardTimeoutError",
    "letter_reward",
    "load_reward_fn",
    "math_reward",
    "missing_fields",
    "reasoning_gym_reward",
]

logger = logging.getLogger(__name__)


# --- built-in rewards --------------------------------------------------------------------


def math_reward(
    prompt: str,
    completion: str,
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    answer: Any,
    answer_format: str = "expression",
    **data_fields: Any,
) -> float:
    """1.0 when the completion's final answer equals `answer` (by `math-verify`), else 0.0.

    `answer` is the reference: a number or a LaTeX/plain expression, with or without `$...$`
    or `\\boxed{}`. `math-verify` extracts the completion's answer (`\\boxed{}` first, then
    "the answer is ...", then the last expression) and compares symbolically and numerically.
    A reference it cannot parse raises `ValueError` (a data problem, not a wrong answer).

    `answer_format` (a data field, default `expression`): `number` demands that the extracted
    answer be a numeral (sign, digits, thousands commas, decimals), not an expression equal to
    the reference. Arithmetic tasks need it: math-verify evaluates what it extracts, so a
    completion that restates the question ("97 * 81") would otherwise score as "7857".

    `math-verify` bounds its own parsing time with `SIGALRM`, which only the main thread may
    use; called from another thread, those limits are turned off (`RewardPool`'s timeout
    still applies, since workers call rewards on their main thread).
    """
    math_verify = _require("math_verify", "math-verify", "math_reward")
    on_main = threading.current_thread() is threading.main_thread()
    parse_kw: dict[str, Any] = {} if on_main else {"parsing_timeout": None}
    verify_kw: dict[str, Any] = {} if on_main else {"timeout_seconds": None}
    reference = str(answer).strip()
    if "$" not in reference and "\\boxed" not in reference:
        reference = f"${reference}$"  # bare LaTeX (`\frac{1}{2}`) parses only inside math mode
    gold = math_verify.parse(reference, **parse_kw)
    if answer is None or not gold:
        raise ValueError(
            f"math_reward: math-verify cannot parse the reference answer {answer!r}; "
            "give the dataset's answer field as a number or a LaTeX expression"
        )
    if answer_format not in ("expression", "number"):
        raise ValueError(
            f"math_reward: answer_format={answer_format!r} is not 'expression' or 'number'; fix the "
            "dataset's answer_format field"
        )
    predicted = math_verify.parse(completion, **parse_kw)
    if answer_format == "number" and not (predicted and _NUMERAL.fullmatch(str(predicted[-1]).strip())):
        return 0.0
    return 1.0 if math_verify.verify(gold, predicted, **verify_kw) else 0.0


_NUMERAL = re.compile(r"[+-]?\d{1,3}(,\d{3})*(\.\d+)?|[+-]?\d+(\.\d+)?")
"""What `answer_format: number` accepts as math-verify's extracted answer text."""


def reasoning_gym_reward(
    prompt: str,
    completion: str,
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    *,
    entry: Mapping[str, Any] | str | None = None,
    question: str | None = None,
    answer: Any = None,
    metadata: Mapping[str, Any] | str | None = None,
    source_dataset: str | None = None,
    answer_tag: str = "answer",
    **data_fields: Any,
) -> float:
    """Score with the reasoning-gym task's own `score_answer` (a float in [0, 1]).

    The reasoning-gym entry is the row's `entry` field when it has one, else the row's
    `question`, `answer` and `metadata` fields (what `reasoning_gym.create_dataset(...)`
    yields); either may arrive JSON-encoded, as data files often store nested fields. The
    task comes from `source_dataset`, else from `metadata["source_dataset"]`. The scored
    answer is the text inside the completion's last `<answer_tag>...</answer_tag>`
    (`reasoning_gym.utils.extract_answer`); a completion without one scores 0.0.
    """
    rg_utils = _require("reasoning_gym.utils", "reasoning-gym", "reasoning_gym_reward")
    record = _reasoning_gym_entry(prompt, entry, question, answer, metadata)
    name = source_dataset or record["metadata"].get("source_dataset")
    if not name:
        raise ValueError(
            "reasoning_gym_reward: the row names no reasoning-gym task; pass a `source_dataset` "
            "field or keep the entry's metadata['source_dataset'] (reasoning-gym writes it)"
        )
    extracted = rg_utils.extract_answer(completion, tag_name=answer_tag)
    if extracted is None:
        return 0.0
    return float(_reasoning_gym_scorer(name)(extracted, record))


def _reasoning_gym_entry(
    prompt: str,
    entry: Mapping[str, Any] | str | None,
    question: str | None,
    answer: Any,
    metadata: Mapping[str, Any] | str | None,
) -> dict[str, Any]:
    if entry is not None:
        record = dict(_decoded("entry", entry))
    else:
        record = {"question": prompt if question is None else question, "answer": answer}
        record["metadata"] = metadata
    record["metadata"] = dict(_decoded("metadata", record.get("metadata") or {}))
    if record.get("answer") is None:
        raise ValueError(
            "reasoning_gym_reward: the row has no reference `answer` (nor an `entry` with one); "
            "keep the fields reasoning-gym generates: question, answer, metadata"
        )
    return record


def _decoded(field: str, value: Mapping[str, Any] | str) -> Mapping[str, Any]:
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, Mapping):
        raise ValueError(f"reasoning_gym_reward: field {field!r} must be a dict, got {type(value).__name__}")
    return value


@functools.cache
def _reasoning_gym_scorer(name: str) -> Callable[[str, dict[str, Any]], float]:
    reasoning_gym = _require("reasoning_gym", "reasoning-gym", "reasoning_gym_reward")
    try:
        return reasoning_gym.get_score_answer_fn(name)
    except ValueError as exc:
        raise ValueError(f"reasoning_gym_reward: reasoning-gym has no task {name!r} ({exc})") from exc


def _require(module_name: str, package: str, user: str) -> Any:
    """Import an optional dependency, saying which package to install when it is missing."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f"{user} needs the {package} package: pip install 'laden[rl]' (or just {package})"
        ) from exc


# --- the process pool ----------------------------------------------------------------------


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
        self._dispatcher = _Dispatcher(
            self.specs, self.names, num_workers=num_workers, timeout_s=float(timeout_s),
            import_timeout_s=self.import_timeout_s, on_error=on_error, error_value=float(error_value),
            recycle=_Recycle(
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


@dataclass(frozen=True, slots=True, kw_only=True)
class _Recycle:
    """When an idle worker is replaced on purpose (None: never for that reason)."""

    max_calls: int | None
    max_rss_bytes: int | None


@dataclass(slots=True)
class _Call:
    """A queued call: its pickled arguments, and whether its future takes the whole outcome."""

    future: concurrent.futures.Future[Any]
    payload: bytes
    outcome: bool


class _Worker:
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
        self.call: _Call | None = None
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


class _Dispatcher:
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
        recycle: _Recycle,
    ):
        self.specs, self.names, self.label = specs, names, describe(specs)
        self.recycle = recycle
        self.timeout_s, self.import_timeout_s = timeout_s, import_timeout_s
        self.on_error, self.error_value = on_error, error_value
        # The first ready worker's `RewardInfo`, or why none will be ready.
        self.ready: concurrent.futures.Future[RewardInfo] = concurrent.futures.Future()
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._pending: deque[_Call] = deque()
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
            self._pending.append(_Call(future, payload, outcome))
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

    def _new_worker(self) -> _Worker:
        return _Worker(self._context, self.specs, self.import_timeout_s)

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

    def _next_call(self) -> _Call | None:
        with self._lock:
            while self._pending:
                call = self._pending.popleft()
                if call.future.set_running_or_notify_cancel():
                    return call
        return None

    def _receive(self, worker: _Worker) -> None:
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

    def _on_exit(self, worker: _Worker) -> None:
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
                "start and `import laden.rl.rewards`); the machine may be overloaded: raise import_timeout_s"
            )
        return (
            f"reward {self.label}: importing {module!r} has not finished after {after_s:g} s: does the module "
            "block at import (a server, input(), a lock)? Move that work into the reward function or under "
            "`if __name__ == '__main__':`, or raise import_timeout_s (reward_import_timeout_s) if the import "
            "is legitimately this slow; the worker was killed"
        )

    def _answered(self, worker: _Worker, kind: str, value: Any, *, rss_bytes: int | None) -> None:
        """A worker answered its call ("ok", "error" or "memory_error"): recycle it if due, resolve the call."""
        worker.num_calls += 1
        retire = self._retirement(worker, memory_error=kind == "memory_error", rss_bytes=rss_bytes)
        if kind == "ok":
            total, parts = value
            self._finish(worker, RewardOutcome(value=total, parts=parts), retire=retire)
        else:
            self._fail(worker, "error", value, retire=retire)

    def _retirement(
        self, worker: _Worker, *, memory_error: bool, rss_bytes: int | None
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
        self, worker: _Worker, outcome: RewardOutcome, *, retire: tuple[Retirement, str] | None = None
    ) -> None:
        call = self._release(worker, replace=False, retire=retire)
        self._settle(call, outcome, None)

    def _fail(
        self,
        worker: _Worker,
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

    def _settle(self, call: _Call | None, outcome: RewardOutcome, kind: FailureKind | None) -> None:
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
        self, worker: _Worker, *, replace: bool, retire: tuple[Retirement, str] | None
    ) -> _Call | None:
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

    def _replace(self, worker: _Worker, *, counter: str = "worker_restarts") -> None:
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
            _import_needs(fn)
        return reward
    except RewardSetupError as exc:
        conn.send(("fatal", str(exc)))
    except BaseException as exc:  # SystemExit from a module that exits at import, too
        conn.send(
            ("fatal", f"loading the reward {describe(specs)} failed: {exc!r}\n{traceback.format_exc()}")
        )
    return None


def _import_needs(fn: Callable[..., Any]) -> None:
    """Import what a built-in needs now, so that a missing package stops the run at start-up."""
    needs = _BUILTIN_NEEDS.get(fn)
    if needs is None:
        return
    try:
        _require(*needs, fn.__name__)
    except ModuleNotFoundError as exc:
        raise RewardSetupError(f"reward_fn 'laden.rl.rewards:{fn.__name__}': {exc}") from None


_BUILTIN_NEEDS: dict[Callable[..., Any], tuple[str, str]] = {
    math_reward: ("math_verify", "math-verify"),
    reasoning_gym_reward: ("reasoning_gym", "reasoning-gym"),
}
"""The optional package (module, distribution) each built-in imports."""


def _exit_with(parent_sentinel: int) -> None:
    """End this worker (and its process group, when it leads one) once the trainer is gone."""
    multiprocessing.connection.wait([parent_sentinel])
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(1)


def letter_reward(
    prompt: str, completion: str, prompt_ids: Any = None, completion_ids: Any = None, *, letter: str, **_: Any
) -> float:
    """The share of the completion's characters that are `letter` (the embedded tiny RL task: a
    random-init model learns to answer with one letter, which the reward separates from step 1)."""
    text = completion.strip()
    return sum(ch == letter for ch in text) / len(text) if text else 0.0
