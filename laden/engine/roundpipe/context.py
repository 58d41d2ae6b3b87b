"""Thread-local phase markers of the library API: optimizer scope and forward-vs-recompute.

`OptimizerCtx` marks a scope as optimizer work: inside it `RoundPipe.parameters()` and
`named_parameters()` mean the master weights (`optim_parameters()`), so an optimizer can be
built the ordinary PyTorch way. `save_for_recompute` / `doing_recompute` /
`get_recompute_data` let a layer keep host-sync-prone results of its forward (a
`torch.nonzero` mask) for the backward's recompute instead of computing them again.

The markers are thread-local, not process-wide: layers run on device worker threads, and
two models may run in one process. The engine enters `forward_scope` around each layer's
first forward and `recompute_scope` around its recompute, keyed by (layer, micro-batch).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import torch

_local = threading.local()
_NOTHING: tuple = ()
_submitted = [0]  # optimizer steps handed to a RoundPipe, process-wide (see `steps_submitted`)
_submitted_lock = threading.Lock()


def note_step_submitted() -> None:
    """`RoundPipe.step` calls it before it queues a `step_fn`."""
    with _submitted_lock:
        _submitted[0] += 1


def steps_submitted() -> int:
    """Optimizer steps handed to any `RoundPipe` in this process so far: `GradScaler.update` tells
    from it whether a step is in flight (it waits for it) or none came since the last update."""
    return _submitted[0]


def _depth(name: str) -> int:
    return getattr(_local, name, 0)


class OptimizerCtx:
    """Within this scope `RoundPipe.parameters()` / `named_parameters()` return the master weights."""

    def __enter__(self) -> None:
        _local.optimizer = _depth("optimizer") + 1

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _local.optimizer = _depth("optimizer") - 1


def doing_optimizer() -> bool:
    """Whether the calling thread is inside an `OptimizerCtx` (or a `step_fn`)."""
    return _depth("optimizer") > 0


class _ForwardSlot:
    """Where one layer's first forward may leave its data for the recompute."""

    def __init__(self) -> None:
        self.data: tuple | None = None


@contextlib.contextmanager
def forward_scope(store: dict[Any, tuple], key: Any) -> Iterator[None]:
    """A layer's first forward: what it passes to `save_for_recompute` lands in `store[key]`."""
    slot = _ForwardSlot()
    previous = getattr(_local, "forward", None)
    _local.forward = slot
    try:
        yield
    finally:
        _local.forward = previous
        if slot.data is not None:
            store[key] = slot.data


@contextlib.contextmanager
def recompute_scope(data: tuple | None) -> Iterator[None]:
    """A layer's recompute: `doing_recompute()` is True and `get_recompute_data()` returns `data`."""
    previous = getattr(_local, "recompute", None)
    _local.recompute = _NOTHING if data is None else data
    try:
        yield
    finally:
        _local.recompute = previous


def save_for_recompute(*data: Any) -> None:
    """Keep `data` from this layer's forward for its recompute; a no-op outside a RoundPipe forward
    that will be recomputed (inference, or a layer whose forward keeps its graph).

    At most once per layer forward; saved tensors must not require grad.
    """
    slot: _ForwardSlot | None = getattr(_local, "forward", None)
    if slot is None:
        return
    if slot.data is not None:
        raise ValueError("save_for_recompute was called twice in one layer forward; save everything at once")
    for item in data:
        if isinstance(item, torch.Tensor) and item.requires_grad:
            raise ValueError("save_for_recompute got a tensor that requires grad; pass tensor.detach()")
    slot.data = tuple(data)


def doing_recompute() -> bool:
    """Whether the calling thread is recomputing a layer's forward for its backward."""
    return getattr(_local, "recompute", None) is not None


def get_recompute_data() -> tuple:
    """The tuple this layer passed to `save_for_recompute` in its forward (empty if it saved none)."""
    data = getattr(_local, "recompute", None)
    if data is None:
        raise RecomputeScopeError(
            "get_recompute_data() is only available while doing_recompute() is True; check it first"
        )
    return data


class RecomputeScopeError(RuntimeError, AssertionError):
    """`get_recompute_data` outside a recompute (an AssertionError too, as code written for it expects)."""
