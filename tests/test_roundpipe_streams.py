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
from test_roundpipe_api import mlp, mse_sum, tied_tiny_qwen3
from test_roundpipe_engine import make_steps, settings, tied_model
from torch.utils._python_dispatch import TorchDispatchMode

from laden import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from laden.engine.roundpipe import RoundPipeEngine, pipeline, runner
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
    real = runner.upload_stage

    def upload_stage(store, lane, layer_ids, **kwargs):
        alive_before.append(sum(any(r() is not None for r in refs) for refs in uploads))
        res = real(store, lane, layer_ids, **kwargs)
        accs = [acc for index, acc in res.param_accs.items() if index not in res.carry_out]
        tensors = [*res.device_params.values(), *res.group_accs.values(), *accs]
        uploads.append([weakref.ref(t) for t in tensors])
        return res

    monkeypatch.setattr(runner, "upload_stage", upload_stage)
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
