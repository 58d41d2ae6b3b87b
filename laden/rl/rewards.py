"""Rewards for RL: load a reward function by import path, two built-ins, and a process pool.

A run names its reward as `reward_fn: "package.module:function"`. The function is called
with keyword arguments `prompt`, `completion` (text), `prompt_ids`, `completion_ids` (token
ids) and every other field of the data row (`answer`, `metadata`, ...), and returns a float.

Built-ins:
- `math_reward`: 1.0 when the completion's final answer equals the row's `answer`, decided
  by `math-verify` (LaTeX and plain expressions, `\\frac{1}{2}` == `0.5`); 0.0 otherwise.
- `reasoning_gym_reward`: the reasoning-gym task's own `score_answer` on the text inside the
  completion's last `<answer>...</answer>` tag.

`RewardPool` runs a reward function in worker processes, so a slow, crashing or hanging
reward cannot stall or kill the trainer. Design decisions and what they cost:
- Workers are `spawn`ed, never forked: forking a process that runs torch's thread pools (or
  CUDA) can deadlock the child. A fresh worker costs an interpreter start plus its imports:
  measured 1.4 s and 230 MB resident per worker on a CPU box, nearly all of it the torch
  that `import laden.rl` pulls in, paid at start-up and again for every replacement.
- Each worker owns a private pipe, and a dispatcher thread in the trainer hands a call to one
  idle worker at a time. A call that runs past `timeout_s` gets its worker killed (its whole
  process group, so subprocesses the reward started die with it) and replaced; nothing else
  is lost, since no queue is shared between workers (a process killed while it uses a shared
  `multiprocessing.Queue` can corrupt it for everyone). `concurrent.futures`'
  `ProcessPoolExecutor` cannot kill one worker; it breaks whole instead.
- `timeout_s` counts from the moment a worker takes the call, not time spent queued, and a
  worker takes calls only once it has imported the reward, so start-up never times out a call.
- A failed call (exception, timeout, worker death, a non-finite or non-numeric result) is
  counted in `stats`, logged once per kind with its error text, and scored `error_value`
  (`on_error="zero"`) or raised to the caller as `RewardError` (`on_error="raise"`).
- Arguments are pickled in the caller's thread, so an unpicklable field fails right there.
- A worker leads its own process group and exits when the trainer dies, so a hung reward
  never outlives a killed trainer.

This module imports only the standard library; `math-verify` and `reasoning-gym` load on
first use (`pip install 'laden[rl]'`). POSIX only (the dispatcher waits on file descriptors,
workers use process groups). Past 600 lines: the pool (two thirds of the file) stays beside
the loader its workers call; it is the part to split out if this module grows.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
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
import signal
import threading
import time
import traceback
import types
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

logger = logging.getLogger(__name__)

RewardFn = Callable[..., float]
"""`fn(prompt, completion, prompt_ids, completion_ids, **data_fields) -> float`."""

_SIGNATURE_HINT = (
    "a reward function takes (prompt, completion, prompt_ids, completion_ids, **data_fields) "
    "and returns a float"
)


# --- loading a reward function by name --------------------------------------------------


def load_reward_fn(spec: str) -> RewardFn:
    """Import the reward function named by `spec`: "pkg.module:func" or "pkg.module.func".

    After a colon, a dotted name (`"pkg.module:Scorer.score"`) walks attributes. Raises
    `ValueError` naming what is missing (module, attribute, or a non-callable object).
    """
    module_name, attr_path = _split_spec(spec)
    module = _import_module(module_name, spec)
    obj: Any = module
    for depth, attr in enumerate(attr_path.split(".")):
        if not hasattr(obj, attr):
            owner = ".".join([module_name, *attr_path.split(".")[:depth]])
            raise ValueError(
                f"reward_fn {spec!r}: {owner!r} has no attribute {attr!r}{_known_names(obj)}; "
                "fix the name after the colon"
            )
        obj = getattr(obj, attr)
    if not callable(obj):
        raise ValueError(
            f"reward_fn {spec!r} names a {type(obj).__name__}, not a callable; {_SIGNATURE_HINT}"
        )
    return obj


def _split_spec(spec: str) -> tuple[str, str]:
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward_fn={spec!r} must be a non-empty string like 'my_pkg.rewards:score'")
    if ":" in spec:
        module_name, _, attr_path = spec.strip().partition(":")
    else:
        module_name, _, attr_path = spec.strip().rpartition(".")
    if not module_name or not attr_path or "" in attr_path.split("."):
        raise ValueError(
            f"reward_fn={spec!r} is not an import path; write 'package.module:function' "
            "(or 'package.module.function')"
        )
    return module_name, attr_path


def _import_module(module_name: str, spec: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        parts = module_name.split(".")
        if exc.name in {".".join(parts[: i + 1]) for i in range(len(parts))}:
            raise ValueError(
                f"reward_fn {spec!r}: no module named {exc.name!r}; check the spelling and that "
                f"its folder is on PYTHONPATH (the working directory is {os.getcwd()})"
            ) from exc
        raise ValueError(
            f"reward_fn {spec!r}: importing {module_name!r} failed because it imports the missing "
            f"module {exc.name!r}; install it"
        ) from exc
    except Exception as exc:
        raise ValueError(
            f"reward_fn {spec!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from exc


def _known_names(obj: Any) -> str:
    """ " (it has: f, g)": the public callables `obj` defines, to spot a misspelled name."""
    namespace = getattr(obj, "__dict__", {})
    home = obj.__name__ if isinstance(obj, types.ModuleType) else None
    names = sorted(
        name
        for name, value in namespace.items()
        if not name.startswith("_")
        and callable(value)
        and (home is None or getattr(value, "__module__", home) == home)  # not what it imports
    )
    if not names:
        return ""
    shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
    return f" (it has: {shown})"


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
class RewardPoolStats:
    """Counts since the pool started (a snapshot)."""

    calls: int = 0
    """Calls finished: scored, failed or timed out."""
    errors: int = 0
    """Calls that raised, returned a non-finite or non-numeric value, or killed their worker."""
    timeouts: int = 0
    """Calls that ran past `timeout_s`."""
    worker_restarts: int = 0
    """Workers started to replace one that was killed or died."""


OnError = Literal["zero", "raise"]
_WORKER_START_TIMEOUT_S = 300.0  # an interpreter start plus the reward module's imports
_MAX_FAILED_STARTS = 3  # consecutive worker start failures before the pool gives up


class RewardPool:
    """Scores rewards in `num_workers` spawned processes, each call bounded by `timeout_s`.

    `await pool.score(**kwargs)` and `pool.score_many([kwargs, ...])` return floats; a failed
    call scores `error_value` (`on_error="zero"`) or raises `RewardError` (`on_error="raise"`)
    and is counted in `pool.stats`. Use as a context manager or call `close()`.

    `fn_spec` must be importable in a fresh interpreter (workers are spawned with the
    trainer's `sys.path` and working directory), and a script that makes a pool needs the
    `if __name__ == "__main__":` guard, since spawned workers import the main module.
    """

    def __init__(
        self,
        fn_spec: str,
        *,
        num_workers: int = 4,
        timeout_s: float = 30.0,
        on_error: OnError = "zero",
        error_value: float = 0.0,
    ) -> None:
        _check_pool_args(num_workers, timeout_s, on_error, error_value)
        load_reward_fn(fn_spec)  # fail here, with the import error, not later in a worker
        self.fn_spec = fn_spec
        self._dispatcher = _Dispatcher(fn_spec, num_workers, float(timeout_s), on_error, float(error_value))
        self._finalizer = weakref.finalize(self, self._dispatcher.close)

    def submit(self, **kwargs: Any) -> concurrent.futures.Future[float]:
        """Queue one call `fn(**kwargs)`; the future resolves to its reward."""
        try:
            payload = pickle.dumps(kwargs, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise ValueError(
                f"reward arguments must be picklable to reach the worker processes: {exc}"
            ) from exc
        return self._dispatcher.submit(payload)

    async def score(self, **kwargs: Any) -> float:
        """The reward of `fn(**kwargs)`, awaited without blocking the event loop."""
        return await asyncio.wrap_future(self.submit(**kwargs))

    def score_many(self, calls: Iterable[Mapping[str, Any]]) -> list[float]:
        """Rewards for many calls, in order; runs them on all workers and blocks until done."""
        futures = [self.submit(**call) for call in calls]
        concurrent.futures.wait(futures)
        return [future.result() for future in futures]

    @property
    def stats(self) -> RewardPoolStats:
        """Calls, errors, timeouts and worker restarts so far."""
        return self._dispatcher.snapshot()

    def close(self) -> None:
        """Stop the workers; calls not yet scored fail with `RuntimeError`. Idempotent."""
        self._finalizer()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _check_pool_args(num_workers: int, timeout_s: float, on_error: str, error_value: float) -> None:
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
    if problems:
        raise ValueError("invalid RewardPool settings: " + "; ".join(problems))


class _Worker:
    """One spawned process, its end of a private pipe, and the call it is running."""

    __slots__ = ("process", "conn", "state", "future", "deadline")

    def __init__(self, context: Any, fn_spec: str) -> None:
        self.conn, child_conn = context.Pipe(duplex=True)
        self.process = context.Process(
            target=_worker_main, args=(child_conn, fn_spec), name="laden-reward", daemon=False
        )
        self.process.start()
        child_conn.close()
        self.state: Literal["starting", "idle", "busy"] = "starting"
        self.future: concurrent.futures.Future[float] | None = None
        self.deadline = time.monotonic() + _WORKER_START_TIMEOUT_S

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
        self, fn_spec: str, num_workers: int, timeout_s: float, on_error: OnError, error_value: float
    ):
        self.fn_spec, self.timeout_s = fn_spec, timeout_s
        self.on_error, self.error_value = on_error, error_value
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._pending: deque[tuple[concurrent.futures.Future[float], bytes]] = deque()
        self._stats = {"calls": 0, "errors": 0, "timeouts": 0, "worker_restarts": 0}
        self._logged: set[str] = set()
        self._closing = False
        self._broken: str | None = None
        self._failed_starts = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._workers = [_Worker(self._context, fn_spec) for _ in range(num_workers)]
        self._thread = threading.Thread(target=self._run, name="laden-reward-dispatch", daemon=True)
        self._thread.start()

    # Called from any thread.

    def submit(self, payload: bytes) -> concurrent.futures.Future[float]:
        future: concurrent.futures.Future[float] = concurrent.futures.Future()
        with self._lock:
            if self._broken is not None:
                raise RuntimeError(self._broken)
            if self._closing:
                raise RuntimeError("this RewardPool is closed; create a new one")
            self._pending.append((future, payload))
        self._wake()
        return future

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
            future, payload = self._next_call()
            if future is None:
                return
            worker.state, worker.future = "busy", future
            worker.deadline = time.monotonic() + self.timeout_s
            with contextlib.suppress(OSError):  # it died: `_receive` sees it and fails the call
                worker.conn.send_bytes(payload)

    def _next_call(self) -> tuple[concurrent.futures.Future[float] | None, bytes]:
        with self._lock:
            while self._pending:
                future, payload = self._pending.popleft()
                if future.set_running_or_notify_cancel():
                    return future, payload
        return None, b""

    def _receive(self, worker: _Worker) -> None:
        try:
            kind, value = worker.conn.recv() if worker.conn.poll() else ("exit", None)
        except (EOFError, OSError):
            kind, value = "exit", None
        if kind == "ready":
            worker.state, self._failed_starts = "idle", 0
        elif kind == "ok":
            self._finish(worker, value)
        elif kind == "error":
            self._fail(worker, "error", f"reward function {self.fn_spec!r} failed:\n{value}")
        elif kind == "fatal":
            self._break(f"reward workers cannot load {self.fn_spec!r}:\n{value}")
        elif not worker.process.is_alive():
            self._on_exit(worker)

    def _on_exit(self, worker: _Worker) -> None:
        code = worker.process.exitcode
        if worker.state == "starting":
            self._failed_starts += 1
            if self._failed_starts >= _MAX_FAILED_STARTS:
                self._break(f"reward workers for {self.fn_spec!r} keep dying at start-up (exit code {code})")
                return
        elif worker.state == "busy":
            message = f"the reward worker for {self.fn_spec!r} died (exit code {code})"
            self._fail(worker, "crash", message, replace=True)
            return
        self._replace(worker)

    def _expire(self, now: float) -> None:
        for worker in list(self._workers):
            if worker.state == "busy" and now >= worker.deadline:
                message = (
                    f"reward function {self.fn_spec!r} ran past timeout_s={self.timeout_s}; its worker "
                    "was killed and replaced (raise timeout_s if the reward is legitimately this slow)"
                )
                self._fail(worker, "timeout", message, replace=True)
            elif worker.state == "starting" and now >= worker.deadline:
                self._break(
                    f"a reward worker took over {_WORKER_START_TIMEOUT_S:.0f} s to import {self.fn_spec!r}"
                )

    def _finish(self, worker: _Worker, value: Any) -> None:
        future, worker.future, worker.state = worker.future, None, "idle"
        with self._lock:
            self._stats["calls"] += 1
        assert future is not None, "a worker answered a call it was not given"
        _resolve(future, value=value)

    def _fail(self, worker: _Worker, kind: str, message: str, *, replace: bool = False) -> None:
        """Count and log a failed call, replace its worker if asked, then resolve the call
        (in that order, so a caller who sees the outcome also sees it in `stats`)."""
        future, worker.future, worker.state = worker.future, None, "idle"
        if replace:
            self._replace(worker)
        with self._lock:
            self._stats["calls"] += 1
            self._stats["timeouts" if kind == "timeout" else "errors"] += 1
        self._log_once(kind, message)
        if future is None:
            return
        if self.on_error == "raise":
            error_type = RewardTimeoutError if kind == "timeout" else RewardError
            _resolve(future, error=error_type(message))
        else:
            _resolve(future, value=self.error_value)

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

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        index = self._workers.index(worker)
        self._workers[index] = _Worker(self._context, self.fn_spec)
        with self._lock:
            self._stats["worker_restarts"] += 1

    def _break(self, message: str) -> None:
        logger.error("%s", message)
        with self._lock:
            self._broken, self._closing = message, True

    def _shutdown(self) -> None:
        with self._lock:
            pending, self._pending = list(self._pending), deque()
            self._closing = True
            reason = self._broken or "the RewardPool was closed before this reward was scored"
        futures = [f for f, _ in pending] + [w.future for w in self._workers if w.future is not None]
        for future in futures:
            _resolve(future, error=RuntimeError(reason))
        for worker in self._workers:
            worker.stop()
        with self._lock:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1


def _resolve(
    future: concurrent.futures.Future[float], *, value: float = 0.0, error: BaseException | None = None
) -> None:
    """Set a future's outcome unless it is already done (cancelled by its caller, say)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)


# --- the worker process ------------------------------------------------------------------


def _worker_main(conn: multiprocessing.connection.Connection, fn_spec: str) -> None:
    """Load the reward, say "ready", then answer calls until told to stop or the pipe closes."""
    with contextlib.suppress(OSError):  # else a timeout kills only the worker itself
        os.setpgid(0, 0)  # its own process group: a timeout kills the reward's subprocesses too
    parent = multiprocessing.parent_process()
    if parent is not None:  # a hung reward must not outlive a trainer that was killed
        threading.Thread(target=_exit_with, args=(parent.sentinel,), daemon=True).start()
    try:
        fn = load_reward_fn(fn_spec)
    except Exception:
        conn.send(("fatal", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            kwargs = pickle.loads(conn.recv_bytes())
        except EOFError:
            return  # the trainer went away
        if kwargs is None:
            return
        try:
            conn.send(("ok", _as_reward(fn(**kwargs))))
        except Exception:
            conn.send(("error", traceback.format_exc()))


def _exit_with(parent_sentinel: int) -> None:
    """End this worker (and its process group, when it leads one) once the trainer is gone."""
    multiprocessing.connection.wait([parent_sentinel])
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(1)


def _as_reward(value: Any) -> float:
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"the reward function returned {value!r}; {_SIGNATURE_HINT}") from None
    if not math.isfinite(reward):
        raise ValueError(f"the reward function returned {reward}; rewards must be finite")
    return reward


def letter_reward(
    prompt: str, completion: str, prompt_ids: Any = None, completion_ids: Any = None, *, letter: str, **_: Any
) -> float:
    """The share of the completion's characters that are `letter` (the embedded tiny RL task: a
    random-init model learns to answer with one letter, which the reward separates from step 1)."""
    text = completion.strip()
    return sum(ch == letter for ch in text) / len(text) if text else 0.0
