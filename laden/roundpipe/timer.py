"""`ModelTimer` and `IterTimer`: per-layer forward / recompute / backward timings, smoothed.

The names and the bookkeeping follow the timing helper of the API laden mirrors: a
`ModelTimer` per model holds, per action (`fwd`, `re`, `bwd`), one estimate per layer; an
`IterTimer` collects one iteration's timed spans (`time_fwd(action, layer, stream)`,
`time_bwd(layers, stream)`, context managers) and hands them to its parent when it is
dropped; `update_times()` folds every finished iteration in. The first iteration is dropped
(start-up noise); later ones enter an exponential moving average that starts from zero and
is rescaled by `1 / (1 - scale)` when read. Before any timing the estimates are the layers'
bytes (backward: twice that), so `get_estimate` says whether it answers in `"time"` (ms) or
`"memory"` (bytes). A backward span timed over several layers is split among them in
proportion to their recompute times. `ModelTimer.VERBOSE` prints each update to stderr.

laden's `RoundPipe` feeds its `model_timer` as the API it mirrors does: each call times every
layer's forward (`fwd`) and recompute (`re`) and each backward stage (`bwd`; the fused stage's
forward, which builds the graph its backward uses, counts as both `fwd` and `re`), and folds
the finished calls in. Spans are CUDA events on a CUDA stream and host clock readings
otherwise (the CPU device). Deliberate difference: `ModelExecutePlan.auto` plans by bytes,
never by these estimates (its module docstring says why).
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from typing import Any, Literal

import torch
from torch import nn

Action = Literal["fwd", "re", "bwd"]
FwdAction = Literal["fwd", "re"]
_ACTIONS: tuple[Action, ...] = ("fwd", "re", "bwd")


class HostEvent:
    """A host clock reading with the part of `torch.cuda.Event`'s interface the timer uses."""

    def __init__(self) -> None:
        self.at_s: float | None = None

    def record(self, stream: Any = None) -> None:
        self.at_s = time.perf_counter()

    def query(self) -> bool:
        return self.at_s is not None

    def elapsed_time(self, end: HostEvent) -> float:
        """Milliseconds from this reading to `end`'s."""
        assert self.at_s is not None and end.at_s is not None, "both events must be recorded"
        return (end.at_s - self.at_s) * 1e3


def _event_pair(stream: Any) -> tuple[Any, Any]:
    if isinstance(stream, torch.cuda.Stream):
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    return HostEvent(), HostEvent()


class LayerTimingContext:
    """Records `start_event` on entry and `end_event` on exit, on `stream`."""

    def __init__(self, start_event: Any, end_event: Any, stream: Any) -> None:
        self.start_event, self.end_event, self.stream = start_event, end_event, stream

    def __enter__(self) -> None:
        self.start_event.record(self.stream)

    def __exit__(self, *exc: object) -> None:
        self.end_event.record(self.stream)


def module_bytes(module: nn.Module) -> int:
    """Parameter and buffer bytes of `module` (recursively)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


class ModelTimer:
    """Smoothed per-layer timings of one model (see the module docstring).

    stage[action]: 0 before any record, 1 after the dropped first one, 2 once timings count.
    scale[action]: the weight the zero-started average still lacks (read as `x / (1 - scale)`).
    estimate[action]: per layer, the (unscaled) estimate.
    """

    SMOOTH_RATE: float = 0.9
    BACKWARD_MULTIPLIER: float = 2.0
    VERBOSE: bool = False

    def __init__(self, layers: list[nn.Module]) -> None:
        self.n_layers = len(layers)
        sizes = [float(module_bytes(layer)) for layer in layers]
        self.stage: dict[Action, int] = dict.fromkeys(_ACTIONS, 0)
        self.scale: dict[Action, float] = dict.fromkeys(_ACTIONS, 0.0)
        self.estimate: dict[Action, list[float]] = {
            "fwd": list(sizes),
            "re": list(sizes),
            "bwd": [s * self.BACKWARD_MULTIPLIER for s in sizes],
        }
        self.iter_results: queue.Queue = queue.Queue()
        self.pending_fwd: dict | None = None
        self.pending_bwd: dict | None = None

    def get_estimate(
        self, run_type: Literal["infer", "train", "fused"]
    ) -> tuple[str, list[float], list[float]]:
        """(source, per-layer forward, per-layer backward): ms when source is "time", bytes when "memory".

        "infer": forward times and no backward; otherwise recompute times and recompute + backward.
        """
        if run_type == "infer":
            fwd = [t / (1.0 - self.scale["fwd"]) for t in self.estimate["fwd"]]
            return ("time" if self.stage["fwd"] == 2 else "memory"), fwd, []
        norm = 1.0 - self.scale["re"]
        fwd = [t / norm for t in self.estimate["re"]]
        bwd = [(r + b) / norm for r, b in zip(self.estimate["re"], self.estimate["bwd"])]
        return ("time" if self.stage["bwd"] == 2 else "memory"), fwd, bwd

    def update_times(self) -> None:
        """Fold in every finished iteration, oldest first; stops at the first one still running."""
        while True:
            if self.pending_fwd is None or self.pending_bwd is None:
                try:
                    self.pending_fwd, self.pending_bwd = self.iter_results.get_nowait()
                except queue.Empty:
                    return
            if not self._finished(self.pending_fwd, self.pending_bwd):
                return
            sums, counts = self._collect(self.pending_fwd, self.pending_bwd)
            self._fold(sums, counts)
            self.pending_fwd = self.pending_bwd = None

    @staticmethod
    def _finished(fwd: dict, bwd: dict) -> bool:
        spans = [pair for per_layer in fwd.values() for events in per_layer for pair in events]
        spans += [pair for events in bwd.values() for pair in events]
        return all(end.query() for _, end in spans)

    def _collect(self, fwd: dict, bwd: dict) -> tuple[dict[Action, list[float]], dict[Action, list[int]]]:
        """Summed ms and span counts per action and layer; backward spans split by recompute time."""
        sums: dict[Action, list[float]] = {a: [0.0] * self.n_layers for a in _ACTIONS}
        counts: dict[Action, list[int]] = {a: [0] * self.n_layers for a in _ACTIONS}
        for action, per_layer in fwd.items():
            for i, events in enumerate(per_layer):
                counts[action][i] = len(events)
                sums[action][i] = sum(start.elapsed_time(end) for start, end in events)
        for layer_ids, events in bwd.items():
            total_ms = sum(start.elapsed_time(end) for start, end in events)
            weight_sum = sum(sums["re"][i] for i in layer_ids)
            for i in layer_ids:
                share = sums["re"][i] / weight_sum if weight_sum else 1 / len(layer_ids)
                sums["bwd"][i] += share * total_ms
                counts["bwd"][i] += len(events)
        for action in _ACTIONS:
            if len(set(counts[action])) > 1:
                raise RuntimeError(
                    f"ModelTimer: {action} spans per layer differ ({counts[action]}); time every layer"
                )
        return sums, counts

    def _fold(self, sums: dict[Action, list[float]], counts: dict[Action, list[int]]) -> None:
        timed = [a for a in _ACTIONS if self.n_layers > 0 and counts[a][0] > 0]
        for action in timed:
            if self.stage[action] == 0:
                self.stage[action] = 1  # the first iteration is start-up noise: dropped
                continue
            if self.stage[action] == 1:
                self.stage[action], self.scale[action] = 2, 1.0
                self.estimate[action] = [0.0] * self.n_layers
            self.scale[action] *= self.SMOOTH_RATE
            rate = self.SMOOTH_RATE
            for i in range(self.n_layers):
                mean_ms = sums[action][i] / counts[action][i]
                self.estimate[action][i] = rate * self.estimate[action][i] + (1 - rate) * mean_ms
        if self.VERBOSE:  # every iteration folded in, the dropped first one too (its estimate: bytes)
            for action in timed:
                for i in range(self.n_layers):
                    mean_ms = sums[action][i] / counts[action][i]
                    now = self.estimate[action][i] / (1.0 - self.scale[action])
                    print(
                        f"Layer {i} {action}  new record: {mean_ms:.3f} ms  new estimate: {now:.3f} ms",
                        file=sys.stderr,
                    )


class IterTimer:
    """One iteration's timed spans; handed to `parent` when this object is dropped."""

    def __init__(self, parent: ModelTimer) -> None:
        self.parent = parent
        self.fwd_events: dict[FwdAction, list[list[tuple[Any, Any]]]] = {
            "fwd": [[] for _ in range(parent.n_layers)],
            "re": [[] for _ in range(parent.n_layers)],
        }
        self.bwd_events: dict[range, list[tuple[Any, Any]]] = {}
        self.bwd_dict_lock = threading.Lock()
        self._submitted = False

    def submit(self) -> None:
        """Hand the spans to the parent now (at most once; otherwise when this object is dropped)."""
        if not self._submitted:
            self._submitted = True
            self.parent.iter_results.put((self.fwd_events, self.bwd_events))

    def __del__(self) -> None:
        self.submit()

    def time_fwd(self, action: FwdAction, layer_idx: int, stream: Any = None) -> LayerTimingContext:
        """A context manager timing one forward (`"fwd"`) or recompute (`"re"`) of layer `layer_idx`."""
        start, end = _event_pair(stream)
        self.fwd_events[action][layer_idx].append((start, end))
        return LayerTimingContext(start, end, stream)

    def time_bwd(self, layer_ids: range, stream: Any = None) -> LayerTimingContext:
        """A context manager timing the backward of the layers `layer_ids` (one stage)."""
        start, end = _event_pair(stream)
        with self.bwd_dict_lock:  # backward stages may be timed from several threads
            self.bwd_events.setdefault(layer_ids, []).append((start, end))
        return LayerTimingContext(start, end, stream)
