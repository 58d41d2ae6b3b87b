"""One call's worth of work: the stage tasks of a forward(-backward) over all micro-batches.

A `Run` turns a plan into tasks in execution order: the forward stages, the fused stage
(forward, loss and backward of the last layers in one residency) and the backward stages
from the last layers to the first. Each task is one residency of its layers on one device
and loops over every micro-batch inside it, so a stage's weights cross the bus once per
direction per call however many micro-batches there are.

What crosses between tasks lives in pre-created `Handoff`s keyed by (layer, micro-batch):
`acts` (stage inputs in forward), `saved` (inputs kept for the backward recompute: the
first layer of each backward stage with `recompute_grain="stage"`, every layer of the
backward stages with `"layer"`), `grads` (gradients w.r.t. a backward stage's input).
Everything is in host memory; GPU memory holds one stage's weights and gradients, the next
stage's prefetched weights, and one micro-batch's activations.

The stage bodies (and how a task is prepared and executed) are in `passes.py`; the device workers that run the tasks in `workers.py`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from laden.engine.roundpipe.device import Lane
from laden.engine.roundpipe.host.store import HostStore, ParamGroup
from laden.engine.roundpipe.plan import ModelExecutePlan
from laden.engine.roundpipe.residency import GradLanding
from laden.engine.roundpipe.transfer import Handoff, HostBuffers, Shared

Grain = Literal["stage", "layer"]
TaskKind = Literal["forward", "fused", "backward"]


@dataclass(frozen=True, slots=True)
class AutocastState:
    """The caller's autocast settings, re-entered in every worker thread (autocast is thread-local)."""

    cuda: tuple[bool, torch.dtype]
    cpu: tuple[bool, torch.dtype]

    @classmethod
    def capture(cls) -> AutocastState:
        return cls(
            cuda=(torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")),
            cpu=(torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),
        )

    @contextlib.contextmanager
    def enter(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for device_type, (enabled, dtype) in (("cuda", self.cuda), ("cpu", self.cpu)):
                if enabled:
                    # Weights are fresh device copies every residency: nothing to cache.
                    stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=False))
            yield


@dataclass(kw_only=True)
class CallSpec:
    """What one `forward_backward` / `forward` call asks for."""

    inputs: list[Handoff]
    labels: list[Handoff] | None
    loss_fn: Callable[[Any, Any], Any] | None
    plan: ModelExecutePlan
    grain: Grain
    backward: bool
    preserve_rng: bool
    autocast: AutocastState
    buf: int
    inbox: int
    required: list[int]
    carried: frozenset[int] = frozenset()  # tied parameters whose gradient stays on the device
    # Buffers (`buffers.py`): whether forward passes copy persistent buffers back to the host, and
    # the values the backward stages upload instead of the host buffers (filled by forward stages).
    write_buffers: bool = True
    saved_buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    keep_outputs: bool = False  # the fused stage parks its outputs too (`return_outputs=True`)
    timer: Any = None  # an `IterTimer` the passes time their layers into (`laden.roundpipe.timer`), or None
    capture: Any = None  # the Hugging Face output capture around this call (`laden.roundpipe.hf_capture`)


@dataclass(eq=False)
class StageTask:
    """One residency of `layers` on some device, looping over every micro-batch."""

    run: Run
    kind: TaskKind
    layers: range
    final: bool = False  # last forward stage of an inference run: its outputs are the result
    inputs: dict[str, Any] | None = None  # its input prefetchers, by role (`passes.task_inputs`)
    # Called at the start of its last micro-batch, once that micro-batch's inputs are queued: the
    # worker's chance to queue the next task's uploads early (`workers._prepare_early`).
    early: Callable[[], None] | None = None

    def weights_ready(self) -> bool:
        """Whether `prepare` would find the stage's weights written (it would not wait for the host)."""
        spec = self.run.spec
        return self.run.store.weights_written(self.weight_groups(), spec.buf, spec.required)

    def weight_groups(self) -> list[ParamGroup]:
        """The parameter groups whose weights the stage's layers read, each once."""
        layers = self.run.store.layers
        return list({g.index: g for layer in self.layers for g in layers[layer].weight_deps()}.values())


@dataclass(eq=False)
class Run:
    """The state shared by one call's tasks (see the module docstring)."""

    store: HostStore
    spec: CallSpec
    on_landed: Callable[[GradLanding], None]
    host_failed: Callable[[], bool] = lambda: False  # a host job (update, landing) raised
    failed: threading.Event = field(default_factory=threading.Event)
    acts: dict[tuple[int, int], Handoff] = field(default_factory=dict)
    saved: dict[tuple[int, int], Handoff] = field(default_factory=dict)
    grads: dict[tuple[int, int], Handoff] = field(default_factory=dict)
    rng: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    losses: list[Handoff | None] = field(default_factory=list)
    outputs: list[Handoff | None] = field(default_factory=list)
    tasks: list[StageTask] = field(default_factory=list)
    carried: dict[int, torch.Tensor] = field(default_factory=dict)  # see `Residency.carried`
    buffers: HostBuffers | None = None  # the pipeline's reusable host buffers for parked data
    shared: Shared = field(default_factory=Shared)  # tensors parked and fetched once per call
    # What layers passed to `save_for_recompute` in forward, by (layer, micro-batch) (`context`).
    recompute_data: dict[tuple[int, int], tuple] = field(default_factory=dict)

    def __post_init__(self) -> None:
        spec, num_layers = self.spec, len(self.store.layers)
        num_mb = len(spec.inputs)
        self.losses = [None] * num_mb
        self.outputs = [None] * num_mb
        training = spec.loss_fn is not None or spec.backward
        if training:
            fwd = list(spec.plan.fwd_plan)
            self.tasks = [StageTask(self, "forward", s) for s in fwd]
            self.tasks.append(StageTask(self, "fused", spec.plan.bwd_plan[0]))
            if spec.backward:
                self.tasks += [StageTask(self, "backward", s) for s in spec.plan.bwd_plan[1:]]
            boundaries = [s.start for s in fwd] + [spec.plan.bwd_plan[0].start]
        else:
            fwd = spec.plan.forward_stages(num_layers)
            self.tasks = [StageTask(self, "forward", s) for s in fwd]
            self.tasks[-1].final = True
            boundaries = [s.start for s in fwd]
        for mb in range(num_mb):
            for start in boundaries:
                self.acts[(start, mb)] = spec.inputs[mb] if start == 0 else Handoff()
            for layer in self.save_layers():
                self.saved[(layer, mb)] = self.acts.get((layer, mb)) or Handoff()
            if spec.backward:
                for s in spec.plan.bwd_plan[:-1]:
                    self.grads[(s.start, mb)] = Handoff()

    def save_layers(self) -> list[int]:
        """Layers whose input the backward recomputes from."""
        if not self.spec.backward:
            return []
        later = self.spec.plan.bwd_plan[1:]
        if self.spec.grain == "stage":
            return [s.start for s in later]
        return [layer for s in later for layer in s]

    @property
    def num_microbatches(self) -> int:
        return len(self.spec.inputs)

    def aborted(self) -> bool:
        return self.failed.is_set() or self.host_failed()


def capture_rng(lane: Lane) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda_state = torch.cuda.get_rng_state(lane.device) if lane.is_cuda else None
    return torch.get_rng_state(), cuda_state


@contextlib.contextmanager
def restored_rng(lane: Lane, state: tuple[torch.Tensor, torch.Tensor | None] | None) -> Iterator[None]:
    """Replay the RNG a layer saw in forward (dropout) during its recompute, then restore the RNG."""
    if state is None:
        yield
        return
    devices = [lane.device] if lane.is_cuda else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], lane.device)
        yield
