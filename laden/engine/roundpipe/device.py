"""A device of the pool and its streams, with the CPU as a stand-in device.

Each CUDA device gets four streams: `compute`, `weights` (host-to-device weight uploads,
prefetched one stage ahead), `h2d` (activations and gradients of the micro-batches) and
`d2h` (everything going back to the host). Weights and activations travel on different
upload streams so that a prefetched stage's weights never queue in front of the input of
the micro-batch that is about to compute.

Memory allocated on a side stream and used on another is protected with
`Tensor.record_stream`, so the caching allocator does not hand it out again before the
consuming stream is done with it. Cross-stream ordering uses CUDA events only; the host
waits on an event only where it must read data (gradients before the optimizer step).

On the CPU every "stream" is the calling thread: copies are synchronous, events are None
and the same scheduling code runs unchanged, which is what lets the CPU tests exercise it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

Event = Any  # torch.cuda.Event on CUDA, None on the CPU


class Lane:
    """One device of the pool: streams, events and copies (no-ops or synchronous on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.compute: Any  # torch.cuda.Stream, or None on the CPU (and likewise below)
        self.weights: Any
        self.h2d: Any
        self.d2h: Any
        if self.is_cuda:
            self.compute = torch.cuda.Stream(device)
            self.weights = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)
            self.d2h = torch.cuda.Stream(device)
        else:
            self.compute = self.weights = self.h2d = self.d2h = None

    @property
    def pin(self) -> bool:
        """Whether host buffers for this device should be page-locked."""
        return self.is_cuda

    @contextlib.contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        """Make `stream` current (and this device current) for the enclosed work."""
        if not self.is_cuda:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            yield

    @contextlib.contextmanager
    def thread_context(self) -> Iterator[None]:
        """Per-thread setup of a worker driving this device."""
        if self.is_cuda:
            with torch.cuda.device(self.device):
                yield
        else:
            yield

    def record(self, stream: Any) -> Event:
        """An event marking the work queued so far on `stream` (None on the CPU)."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Event) -> None:
        """Make `stream` wait for `event` (recorded on any device); no host blocking."""
        if event is not None and self.is_cuda:
            stream.wait_event(event)

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the allocator `tensor` is used on `stream` (it was allocated on another one)."""
        if self.is_cuda:
            tensor.record_stream(stream)

    def finished(self, event: Event) -> bool:
        """Whether the work `event` marks has completed (no event: nothing pending); never blocks."""
        return event is None or bool(event.query())

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


def wait_host(event: Event) -> None:
    """Block the calling host thread until `event` completed (deliberate sync: the host reads the data)."""
    if event is not None:
        event.synchronize()


def default_devices() -> list[torch.device]:
    """Every visible GPU of this process, or the CPU when there is none."""
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")]


_LANES: dict[torch.device, Lane] = {}


def lanes_for(devices: list[torch.device]) -> list[Lane]:
    """Lanes (and their streams) are created once per device and shared by all models."""
    out = []
    for d in devices:
        if d.type == "cuda" and d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
        if d not in _LANES:
            _LANES[d] = Lane(d)
        out.append(_LANES[d])
    return out
