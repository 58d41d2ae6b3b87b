"""The fsdp engine on CUDA: NCCL data/context/tensor parallel and the streamed optimizer step with real streams."""

from __future__ import annotations

import pytest
import torch
from test_fsdp import SETTINGS, STEPS, check_against_reference, run_engine, split_steps, tiny_model
from workers import run_workers

from laden.engine.fsdp import FSDPEngine

NCCL = "cpu:gloo,cuda:nccl"


def _gpu_worker(rank: int, world_size: int, mode: dict, options: dict):
    torch.backends.cuda.matmul.allow_tf32 = False
    engine = FSDPEngine(
        tiny_model(),
        **mode,
        device=torch.device("cuda", rank),
        dtype=torch.float32,
        optimizer_dtype=torch.float32,
        optim=SETTINGS,
        **options,
    )
    dp = mode.get("dp", 1)
    metrics, grads, params = run_engine(engine, split_steps(STEPS, dp))
    to_cpu = lambda d: {k: v.cpu() for k, v in d.items()}  # noqa: E731
    return metrics, to_cpu(grads), to_cpu(params)


@pytest.mark.multigpu
@pytest.mark.parametrize("mode", [{"dp": 2}, {"cp": 2}, {"tp": 2}], ids=["d2", "c2", "t2"])
def test_two_gpus_equal_reference(mode):
    check_against_reference(run_workers(_gpu_worker, 2, mode, {}, backend=NCCL), rtol=1e-3, atol=1e-4)


@pytest.mark.multigpu
@pytest.mark.parametrize(
    "options",
    [
        {"offload_params": True},
        {"per_layer_optim_step": True},
        {"offload_params": True, "per_layer_optim_step": True},
    ],
    ids=["offload", "per_layer", "offload_per_layer"],
)
def test_two_gpus_memory_knobs_equal_reference(options):
    check_against_reference(
        run_workers(_gpu_worker, 2, {"dp": 2}, options, backend=NCCL), rtol=1e-3, atol=1e-4
    )


@pytest.mark.gpu
def test_streamed_step_on_one_gpu_equals_reference():
    """Side-stream uploads/downloads with prefetch give the plain AdamW result (no process group)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    engine = FSDPEngine(
        tiny_model(),
        device=torch.device("cuda", 0),
        dtype=torch.float32,
        optimizer_dtype=torch.float32,
        optim=SETTINGS,
        per_layer_optim_step=True,
        optim_step_prefetch_layers=2,
    )
    metrics, grads, params = run_engine(engine, split_steps(STEPS, 1))
    cpu = lambda d: {k: v.cpu() for k, v in d.items()}  # noqa: E731
    check_against_reference([(metrics, cpu(grads), cpu(params))], rtol=1e-3, atol=1e-4)


def _gpu_checkpoint_worker(rank: int, world_size: int, path: str, options: dict):
    def engine():
        return FSDPEngine(
            tiny_model(),
            dp=world_size,
            device=torch.device("cuda", rank),
            dtype=torch.bfloat16,
            optim=SETTINGS,
            **options,
        )

    first = engine()
    run_engine(first, split_steps(STEPS[:1], world_size))
    first.save_checkpoint(path)
    second = engine()
    second.load_checkpoint(path)
    pairs = zip(
        first.state_dict()["optimizer"]["state"].items(), second.state_dict()["optimizer"]["state"].items()
    )
    for (fqn, a), (_, b) in pairs:
        for key in a:
            x, y = a[key], b[key]
            x = x.full_tensor() if hasattr(x, "full_tensor") else x
            y = y.full_tensor() if hasattr(y, "full_tensor") else y
            torch.testing.assert_close(x.cpu(), y.cpu(), rtol=0, atol=0, msg=f"{fqn}/{key}")
    return True


@pytest.mark.multigpu
@pytest.mark.parametrize(
    "options",
    [{}, {"offload_params": True, "per_layer_optim_step": True}],
    ids=["resident", "offload_per_layer"],
)
def test_two_gpus_checkpoint_round_trip(tmp_path, options):
    assert all(run_workers(_gpu_checkpoint_worker, 2, str(tmp_path / "ckpt"), options, backend=NCCL))
