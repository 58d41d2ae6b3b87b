"""Stream discipline and residency lifetimes of roundpipe, checked on the CPU.

On CUDA every piece of device work must be queued on one of a lane's streams (`compute`,
`weights`, `h2d`, `d2h`), which are ordered with each other by events. Work issued outside
them lands on the worker thread's default stream, which does not synchronise with the
engine's non-blocking streams: it runs whenever it likes, and its results are garbage. On
the CPU nothing runs asynchronously, so such a bug never shows in the numbers; these tests
catch it structurally instead. A lane whose streams are labels records which one is
current, and a dispatch mode flags every tensor operation of a call's device work that
runs while none is (views are exempt: they launch nothing).

The same instrumented lane checks that stages release their device tensors: at most the
stage computing and the one prefetched may hold device memory at once.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from roundpipe_cases import make_steps, mlp, mse_sum, settings, tied_model, tied_tiny_qwen3
from torch.utils._python_dispatch import TorchDispatchMode

from laden import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from laden.engine.roundpipe import RoundPipeEngine, passes, pipeline
from laden.engine.roundpipe.call import StageTask
from laden.engine.roundpipe.device import Lane
from laden.model.split import causal_lm_loss, shift_labels

# The tiny stage limits below also warn when the first batch re-plans with its activations.
pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:the largest layer needs .* activations of:UserWarning"),
]


class LabelledLane(Lane):
    """A CPU lane whose streams are labels; `current()` says which one the calling thread is on."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.compute, self.weights, self.h2d, self.d2h = "compute", "weights", "h2d", "d2h"
        self._local = threading.local()

    @contextlib.contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        before = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = before

    def current(self) -> str | None:
        return getattr(self._local, "stream", None)


class OffStreamOps(TorchDispatchMode):
    """Records tensor operations (other than views) issued while the lane has no current stream."""

    def __init__(self, lane: LabelledLane) -> None:
        super().__init__()
        self.lane = lane
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.lane.current() is None and not func.is_view:
            self.found.append(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def audited(pipe: pipeline.Pipeline, monkeypatch: pytest.MonkeyPatch) -> Iterator[OffStreamOps]:
    """Put a labelled lane under `pipe` and audit the device work of every call (not the host's)."""
    lane = LabelledLane()
    pipe.lanes = [lane]
    mode = OffStreamOps(lane)
    real = pipeline.run_tasks

    def run_tasks(run, lanes):
        with mode:
            real(run, lanes)

    monkeypatch.setattr(pipeline, "run_tasks", run_tasks)
    yield mode


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, torch.float32])
def test_engine_device_work_stays_on_lane_streams(monkeypatch, grain, compute_dtype):
    """bf16 compute over fp32 masters folds each micro-batch's gradient into an fp32 accumulator:
    that add must run on the compute stream (it once ran on the default stream: NaN on the H200)."""
    with pytest.warns(UserWarning, match="largest layer"):
        engine = RoundPipeEngine(tied_model(), optim=settings(), compute_dtype=compute_dtype,
                                 recompute_grain=grain, model_memory_limit=0.0004)  # fmt: skip
    assert len(engine.plan.bwd_plan) > 2
    with audited(engine.pipe, monkeypatch) as mode:
        for mbs in make_steps(2):
            out = engine.train_batch(mbs, global_num_loss_tokens=sum(mb.num_loss_tokens for mb in mbs))
            assert torch.isfinite(out["loss"])
    assert mode.found == []


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_library_device_work_stays_on_lane_streams(monkeypatch, grain):
    """The library API, bf16 weights with fp32 gradients (the same per-micro-batch folds)."""
    model = tied_tiny_qwen3().to(torch.bfloat16)
    rp = RoundPipe(model, optim_dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (4, 8), generator=torch.Generator().manual_seed(0))
    plan = ModelExecutePlan(fwd_plan=[range(0, 2)], bwd_plan=[range(2, 5), range(1, 2), range(0, 1)])
    cfg = RoundPipeRunConfig(num_microbatch=2, recompute_grain=grain, execute_plan=plan)
    with audited(rp.pipe, monkeypatch) as mode:
        rp.forward_backward(input_kwargs={"input_ids": ids}, label=shift_labels(ids), loss_fn=causal_lm_loss,
                            run_config=cfg)  # fmt: skip
        rp(input_ids=ids, roundpipe_run_config=cfg)
    assert mode.found == []


def track_residencies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """After every stage upload, how many earlier residencies still hold a live device tensor
    (other than a tied weight's gradient kept for its owner's stage: `Residency.carry_out`)."""
    uploads: list[list[weakref.ref]] = []
    alive_before: list[int] = []
    real = passes.upload_stage

    def upload_stage(store, lane, layer_ids, **kwargs):
        alive_before.append(sum(any(r() is not None for r in refs) for refs in uploads))
        res = real(store, lane, layer_ids, **kwargs)
        accs = [acc for index, acc in res.param_accs.items() if index not in res.carry_out]
        tensors = [*res.device_params.values(), *res.group_accs.values(), *accs]
        uploads.append([weakref.ref(t) for t in tensors])
        return res

    monkeypatch.setattr(passes, "upload_stage", upload_stage)
    return alive_before


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_stages_release_their_device_tensors(monkeypatch, grain):
    """A new stage is uploaded while at most one earlier stage (the one computing) holds device memory."""
    alive_before = track_residencies(monkeypatch)
    rp = RoundPipe(mlp())
    plan = ModelExecutePlan(fwd_plan=[range(0, 1), range(1, 2), range(2, 3)],
                            bwd_plan=[range(3, 7), range(2, 3), range(1, 2), range(0, 1)])  # fmt: skip
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    cfg = RoundPipeRunConfig(num_microbatch=4, recompute_grain=grain, execute_plan=plan)
    for _ in range(2):
        rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum, run_config=cfg)
    assert len(alive_before) == 2 * 7
    assert max(alive_before) <= 1


def test_engine_stages_release_their_device_tensors(monkeypatch):
    """The same for a causal LM in bf16 compute (decoder states, rotary caches, fp32 accumulators)."""
    alive_before = track_residencies(monkeypatch)
    with pytest.warns(UserWarning, match="largest layer"):
        engine = RoundPipeEngine(tied_model(), optim=settings(), compute_dtype=torch.bfloat16,
                                 optim_step="async", model_memory_limit=0.0004)  # fmt: skip
    for mbs in make_steps(2):
        engine.train_batch(mbs, global_num_loss_tokens=sum(mb.num_loss_tokens for mb in mbs))
    num_stages = len(engine.plan.fwd_plan) + len(engine.plan.bwd_plan)
    assert len(alive_before) == 2 * num_stages
    assert max(alive_before) <= 1


def record_input_copies(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """The order in which stage uploads, input copies and the ends of stages are queued: ("upload",
    first layer), (task kind, first layer, role, index) per input copy, ("release", first layer)."""
    from laden.engine.roundpipe import passes

    log: list[tuple] = []
    tags: dict[int, tuple] = {}
    real_upload, real_build, real_fetch = passes.upload_stage, passes._build_inputs, passes._Prefetcher._fetch
    real_release = passes.release

    def upload_stage(store, lane, layer_ids, **kwargs):
        log.append(("upload", layer_ids[0]))
        return real_upload(store, lane, layer_ids, **kwargs)

    def release(res):
        log.append(("release", res.layer_ids[0]))
        real_release(res)

    def build_inputs(task, lane):
        prefetchers = real_build(task, lane)
        for role, p in prefetchers.items():
            tags[id(p)] = (task.kind, task.layers.start, role)
        return prefetchers

    def fetch(self, i):
        log.append((*tags[id(self)], i))
        return real_fetch(self, i)

    monkeypatch.setattr(passes, "upload_stage", upload_stage)
    monkeypatch.setattr(passes, "release", release)
    monkeypatch.setattr(passes, "_build_inputs", build_inputs)
    monkeypatch.setattr(passes._Prefetcher, "_fetch", fetch)
    return log


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_input_copies_are_queued_in_the_order_the_compute_needs_them(monkeypatch, grain):
    """The `h2d` stream copies in queue order, so a copy queued before one needed sooner delays it.
    Each stage's inputs are queued in the order its compute reads them (a backward stage: each
    recompute's input, the output gradient after the first one), and, with one device, the next
    stage's weights and first micro-batch inputs are queued at the start of the last micro-batch
    of the stage before it (after the inputs of that micro-batch's first compute, before its end;
    here every input of it, the stages having at most two layers)."""
    log = record_input_copies(monkeypatch)
    rp = RoundPipe(mlp())
    plan = ModelExecutePlan(
        fwd_plan=[range(0, 2), range(2, 3)], bwd_plan=[range(3, 7), range(1, 3), range(0, 1)]
    )
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    num_mb = 4
    cfg = RoundPipeRunConfig(num_microbatch=num_mb, recompute_grain=grain, execute_plan=plan)
    rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum, run_config=cfg)

    tasks = [("forward", 0), ("forward", 2), ("fused", 3), ("backward", 1), ("backward", 0)]
    assert [entry[1] for entry in log if entry[0] == "upload"] == [first for _, first in tasks]
    assert [entry[1] for entry in log if entry[0] == "release"] == [first for _, first in tasks]
    recompute_starts = {1: [1] if grain == "stage" else [2, 1], 0: [0]}
    for n, (kind, first) in enumerate(tasks):
        if kind == "backward":
            starts = recompute_starts[first]
            need = [
                ("saved", mb * len(starts) + j) if k == 0 else ("grads", mb)
                for mb in range(num_mb)
                for j in range(len(starts))
                for k in ((0, 1) if j == 0 else (0,))
            ]
        else:
            need = [
                (role, mb) for mb in range(num_mb) for role in (["x", "labels"] if kind == "fused" else ["x"])
            ]
        copies = [(i, entry[2:]) for i, entry in enumerate(log) if entry[:2] == (kind, first)]
        assert [c for _, c in copies] == need
        if n == 0:
            continue
        upload = [i for i, entry in enumerate(log) if entry[0] == "upload"][n]
        first_copies = [i for i, c in copies if c[1] == 0]
        previous_last = max(i for i, entry in enumerate(log) if entry[:2] == tasks[n - 1])
        previous_end = [i for i, entry in enumerate(log) if entry[0] == "release"][n - 1]
        assert previous_last < upload < min(first_copies) <= max(first_copies) < previous_end


def test_the_next_stage_is_prepared_after_the_stage_when_its_weights_are_not_written(monkeypatch):
    """The early upload never waits for the host optimizer with a micro-batch left unqueued: when
    the next stage's weights are not written yet, it is prepared after the stage, as before."""
    log = record_input_copies(monkeypatch)
    monkeypatch.setattr(StageTask, "weights_ready", lambda self: False)
    rp = RoundPipe(mlp())
    plan = ModelExecutePlan(fwd_plan=[range(0, 2)], bwd_plan=[range(2, 7), range(0, 2)])
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan)
    rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum, run_config=cfg)
    events = [entry[:2] for entry in log if entry[0] in ("upload", "release")]
    assert events == [
        ("upload", 0),
        ("release", 0),
        ("upload", 2),
        ("release", 2),
        ("upload", 0),
        ("release", 0),
    ]
