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
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from laden.engine.roundpipe.device import Event, Lane


class Aborted(Exception):
    """Another worker failed; this one stops waiting."""


class Handoff:
    """One micro-batch's pytree in host memory (see the module docstring)."""

    __slots__ = ("_ready", "event", "leaves", "spec")

    def __init__(self) -> None:
        self._ready = threading.Event()
        self.leaves: list[Any] = []
        self.spec: pytree.TreeSpec | None = None
        self.event: Event = None

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
        """Drop the host tensors (already consumed); copies queued from them stay valid."""
        self.leaves = []

    def host_tree(self) -> Any:
        """The data as host tensors; the caller must have waited for `event` before reading them."""
        return self.leaves if self.spec is None else pytree.tree_unflatten(self.leaves, self.spec)


def park(lane: Lane, tree: Any, *, into: Handoff | None = None, flat: bool = False) -> Handoff:
    """Copy a device pytree (or a flat list with None entries when `flat`) to host memory.

    Fills `into` (a handoff a consumer may already be waiting on) or a new handoff.
    """
    h = Handoff() if into is None else into
    leaves, spec = (list(tree), None) if flat else pytree.tree_flatten(tree)
    lane.wait(lane.d2h, lane.record(lane.compute))
    with torch.no_grad(), lane.on(lane.d2h):
        out: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                host = torch.empty(leaf.shape, dtype=leaf.dtype, pin_memory=lane.pin)
                host.copy_(leaf.detach(), non_blocking=True)
                lane.keep_alive(leaf, lane.d2h)
                out.append(host)
            else:
                out.append(leaf)
        h.event = lane.record(lane.d2h)
    h.leaves, h.spec = out, spec
    h._ready.set()
    return h


def fetch(
    lane: Lane, h: Handoff, abort: Callable[[], bool], *, grad_leaves: bool = False
) -> tuple[Any, Event]:
    """Queue the copy of a handoff to `lane`'s device; float leaves become grad-requiring leaves if asked.

    Returns the pytree (or the flat list) of device tensors and the copy's event: the
    caller makes the compute stream wait on it right before use, so that fetching the next
    micro-batch overlaps the current one's compute.
    """
    h.wait(abort)
    lane.wait(lane.h2d, h.event)
    with torch.no_grad(), lane.on(lane.h2d):
        out: list[Any] = []
        for leaf in h.leaves:
            if isinstance(leaf, torch.Tensor):
                dev = torch.empty(leaf.shape, dtype=leaf.dtype, device=lane.device)
                dev.copy_(leaf, non_blocking=True)
                lane.keep_alive(dev, lane.compute)
                out.append(dev)
            else:
                out.append(leaf)
        event = lane.record(lane.h2d)
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
