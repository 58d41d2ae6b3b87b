"""Micro-batch data parked in host memory between stages, and its copies to and from a device.

A `Handoff` holds one micro-batch's pytree (a stage input, an output, a gradient list) as
host tensors plus the event of the copy that filled them, and a thread event that says the
copy has been queued. Producers park on their device's `d2h` stream after the compute that
made the data; consumers (possibly on another device) make their `h2d` stream wait on the
producer's event, copy, and make their compute stream wait on the copy. No host thread
blocks on device work here; host buffers are page-locked when a GPU is present so that
these copies are truly asynchronous.

Trade-off: every stage boundary costs a round trip through host memory even when producer
and consumer share a device. That is what keeps GPU memory flat in the number of
micro-batches and stages (the point of the engine), and at `[T, H]` per boundary it is
small next to the weights each stage uploads.

Two things keep the host thread that feeds the GPU from paying for that round trip:

- `HostBuffers`: the page-locked buffers of parked data are reused across micro-batches and
  calls. A buffer goes back to the pool when its handoff is consumed, with the events of the
  copies that read it, and is handed out again only once they have completed (any such
  buffer: one whose copy is still queued holds none back). Torch's caching host allocator
  also waits for those events, working through its event queue in order; with the host
  running ahead of the device, some allocations in the steady state still found no free block
  and called `cudaHostAlloc`, up to 56 ms for 64 MiB on an H200 with the feeding thread
  blocked, and a step made 760 such allocations (`benchmarks/RESULTS.md`, sixth round).
- `Shared`: a tensor that every layer passes on unchanged (a decoder state's position ids and
  packed-row offsets) is parked once per call and fetched once per device, not once per
  stage boundary: a copy each way and a page-locked allocation fewer per layer.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from laden.engine.roundpipe.device import Event, Lane


class Aborted(Exception):
    """Another worker failed; this one stops waiting."""


class HostBuffers:
    """Reusable page-locked host buffers for parked tensors (see the module docstring).

    `take` hands out a view of a free buffer whose readers have finished (any of them: a
    buffer whose copy is still queued does not hold back the ones behind it), or allocates
    one; `give` returns buffers with the events of the copies that read them. Buffers are
    byte buffers of a power-of-two size, as torch's host allocator rounds them, so calls
    whose micro-batches differ in length share them; `end_call` drops the free buffers the
    call did not use, so the pool holds no more than the last call's working set. Thread-safe:
    every device's worker parks and consumes. Without pinning (the CPU as the device) buffers
    are reused the same way; copies are synchronous there.
    """

    def __init__(self, *, pin: bool) -> None:
        self.pin = pin
        self._free: dict[
            int, list[tuple[torch.Tensor, list[Event], int]]
        ] = {}  # size -> (buf, readers, call)
        self._lock = threading.Lock()
        self._call = 0
        self.allocated = 0  # buffers ever allocated (a test counts them)

    def take(self, shape: torch.Size, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(the buffer, a `shape` x `dtype` view of its start)."""
        nbytes = math.prod(shape) * dtype.itemsize
        size = 1 << max(nbytes - 1, 511).bit_length()  # a power of two, at least 512 bytes
        buf = None
        with self._lock:
            free = self._free.get(size, [])
            for i, (_, readers, _) in enumerate(free):
                if all(e is None or e.query() for e in readers):
                    buf = free.pop(i)[0]
                    break
            else:
                self.allocated += 1
        if buf is None:
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        return buf, buf[:nbytes].view(dtype).view(shape)

    def give(self, buffers: list[torch.Tensor], readers: list[Event]) -> None:
        with self._lock:
            for buf in buffers:
                self._free.setdefault(buf.numel(), []).append((buf, readers, self._call))

    def end_call(self) -> None:
        """After a call: drop the free buffers it did not use (back to torch's host allocator)."""
        with self._lock:
            for size, free in list(self._free.items()):
                free[:] = [entry for entry in free if entry[2] == self._call]
                if not free:
                    del self._free[size]
            self._call += 1

    def clear(self) -> None:
        """Drop every free buffer (back to torch's host allocator); the next call allocates anew."""
        with self._lock:
            self._free.clear()

    def free_bytes(self) -> int:
        with self._lock:
            return sum(size * len(free) for size, free in self._free.items())


class Shared:
    """One call's tensors that are parked and fetched once although several handoffs carry them.

    Only tensors that need no gradient and are passed on unchanged qualify: integer tensors
    (position ids, packed-row offsets), recognised as the same object at the same version
    counter. Device tensors are remembered per device; the memo holds them until the call
    ends (a few small tensors per micro-batch).
    """

    def __init__(self) -> None:
        self._parked: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}  # id(device) -> host
        self._fetched: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def eligible(t: torch.Tensor) -> bool:
        return not (t.is_floating_point() or t.is_complex() or t.requires_grad)

    def parked(self, dev: torch.Tensor) -> torch.Tensor | None:
        """The host copy of device tensor `dev` made (or fetched from) in this call, if unchanged."""
        with self._lock:
            hit = self._parked.get(id(dev))
        return hit[2] if hit is not None and hit[0] is dev and hit[1] == dev._version else None

    def fetched(self, device: torch.device, host: torch.Tensor) -> torch.Tensor | None:
        """The copy of `host` already on `device` in this call, if any."""
        with self._lock:
            hit = self._fetched.get((device, id(host)))
        return hit[1] if hit is not None and hit[0] is host else None

    def remember(self, dev: torch.Tensor, host: torch.Tensor) -> None:
        """`dev` and `host` hold the same data (one was copied from the other): parking `dev` again
        gives `host`, fetching `host` to `dev`'s device gives `dev`."""
        with self._lock:
            self._parked[id(dev)] = (dev, dev._version, host)
            self._fetched[(dev.device, id(host))] = (host, dev)


class Handoff:
    """One micro-batch's pytree in host memory (see the module docstring)."""

    __slots__ = ("_ready", "event", "leaves", "pool", "pooled", "readers", "spec")

    def __init__(self) -> None:
        self._ready = threading.Event()
        self.leaves: list[Any] = []
        self.spec: pytree.TreeSpec | None = None
        self.event: Event = None
        self.pool: HostBuffers | None = None  # where `pooled` goes back on `release`
        self.pooled: list[torch.Tensor] = []  # the leaves taken from `pool`
        self.readers: list[Event] = []  # the copies that read them

    @classmethod
    def of_host(cls, tree: Any, *, pin: bool = False) -> Handoff:
        """Wrap data that already lives in host memory (the caller's inputs and labels).

        With `pin`, tensors are copied to page-locked memory first (token ids: small), so
        that their upload is asynchronous like every other copy.
        """
        h = cls()
        leaves, h.spec = pytree.tree_flatten(tree)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu":
                raise ValueError(f"inputs and labels must be CPU tensors; got one on {leaf.device}")
        h.leaves = [
            leaf.pin_memory() if pin and isinstance(leaf, torch.Tensor) and not leaf.is_pinned() else leaf
            for leaf in leaves
        ]
        h._ready.set()
        return h

    def is_ready(self) -> bool:
        return self._ready.is_set()

    def wait(self, abort: Callable[[], bool]) -> None:
        while not self._ready.wait(timeout=0.05):
            if abort():
                raise Aborted

    def release(self) -> None:
        """Drop the host tensors (already consumed); copies queued from them stay valid: pooled
        buffers go back to their pool with the events of those copies."""
        if self.pool is not None and self.pooled:
            self.pool.give(self.pooled, self.readers)
        self.leaves, self.pooled, self.readers = [], [], []

    def host_tree(self) -> Any:
        """The data as host tensors; the caller must have waited for `event` before reading them."""
        return self.leaves if self.spec is None else pytree.tree_unflatten(self.leaves, self.spec)


def park(
    lane: Lane,
    tree: Any,
    *,
    into: Handoff | None = None,
    flat: bool = False,
    pool: HostBuffers | None = None,
    shared: Shared | None = None,
) -> Handoff:
    """Copy a device pytree (or a flat list with None entries when `flat`) to host memory.

    Fills `into` (a handoff a consumer may already be waiting on) or a new handoff. With
    `pool`, host buffers come from it and go back when the handoff is released (only for
    data a consumer fetches and releases: not for what the host keeps, like outputs); with
    `shared`, tensors already parked unchanged in this call are not copied again.
    """
    h = Handoff() if into is None else into
    leaves, spec = (list(tree), None) if flat else pytree.tree_flatten(tree)
    lane.wait(lane.d2h, lane.record(lane.compute))
    with torch.no_grad(), lane.on(lane.d2h):
        out: list[Any] = []
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                out.append(leaf)
                continue
            share = shared is not None and Shared.eligible(leaf)
            host = shared.parked(leaf) if share else None  # type: ignore[union-attr]
            if host is None:
                if pool is None or share:
                    host = torch.empty(leaf.shape, dtype=leaf.dtype, pin_memory=lane.pin)
                else:
                    buf, host = pool.take(leaf.shape, leaf.dtype)
                    h.pooled.append(buf)
                host.copy_(leaf.detach(), non_blocking=True)
                lane.keep_alive(leaf, lane.d2h)
                if share:
                    shared.remember(leaf, host)  # type: ignore[union-attr]
            out.append(host)
        h.event = lane.record(lane.d2h)
    h.pool = pool if h.pooled else None
    h.leaves, h.spec = out, spec
    h._ready.set()
    return h


def fetch(
    lane: Lane,
    h: Handoff,
    abort: Callable[[], bool],
    *,
    grad_leaves: bool = False,
    shared: Shared | None = None,
) -> tuple[Any, Event]:
    """Queue the copy of a handoff to `lane`'s device; float leaves become grad-requiring leaves if asked.

    Returns the pytree (or the flat list) of device tensors and the copy's event: the
    caller makes the compute stream wait on it right before use, so that fetching the next
    micro-batch overlaps the current one's compute. With `shared`, a tensor this call already
    has on this device is not copied again: its copy was queued earlier on the same `h2d`
    stream (the returned event covers it), or a stage on this device made it on the compute
    stream that reads it.
    """
    h.wait(abort)
    lane.wait(lane.h2d, h.event)
    with torch.no_grad(), lane.on(lane.h2d):
        out: list[Any] = []
        for leaf in h.leaves:
            if not isinstance(leaf, torch.Tensor):
                out.append(leaf)
                continue
            share = shared is not None and Shared.eligible(leaf)
            dev = shared.fetched(lane.device, leaf) if share else None  # type: ignore[union-attr]
            if dev is None:
                dev = torch.empty(leaf.shape, dtype=leaf.dtype, device=lane.device)
                dev.copy_(leaf, non_blocking=True)
                lane.keep_alive(dev, lane.compute)
                if share:
                    shared.remember(dev, leaf)  # type: ignore[union-attr]
            out.append(dev)
        event = lane.record(lane.h2d)
    if h.pooled:
        h.readers.append(event)
    if grad_leaves:
        out = [t.requires_grad_(True) if _is_float_tensor(t) else t for t in out]
    return (out if h.spec is None else pytree.tree_unflatten(out, h.spec)), event


def float_leaves(tree: Any) -> list[Any]:
    """The leaves of `tree`, in flatten order (what a gradient list is aligned with)."""
    return pytree.tree_flatten(tree)[0]


def as_leaves(tree: Any) -> Any:
    """A copy of `tree` whose float tensors are fresh grad-requiring leaves (for a recompute)."""
    leaves, spec = pytree.tree_flatten(tree)
    fresh = [t.detach().requires_grad_(True) if _is_float_tensor(t) else t for t in leaves]
    return pytree.tree_unflatten(fresh, spec)


def _is_float_tensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def input_grads(inputs: Any) -> list[torch.Tensor | None]:
    """Gradients of a stage's input leaves after backward (None where none arrived)."""
    return [t.grad if _is_float_tensor(t) and t.requires_grad else None for t in float_leaves(inputs)]
