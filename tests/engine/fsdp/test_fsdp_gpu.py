"""The fsdp engine on CUDA: NCCL data/context/tensor parallel and the streamed optimizer step with real streams."""

from __future__ import annotations

import pytest
import torch
from fsdp_cases import SETTINGS, STEPS, check_against_reference, run_engine, split_steps, tiny_model
from workers import run_workers

from laden.engine.fsdp import FSDPEngine
from laden.engine.fsdp.checkpoint import load_dcp, save_dcp

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
    save_dcp(first.state_dict(), path)
    second = engine()
    state = second.state_dict()
    load_dcp(state, path)
    second.load_state_dict(state)
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


@pytest.mark.gpu
def test_offload_frees_the_gpu_and_onload_trains_bitwise():
    """One process on CUDA: offload gives back the parameters', gradients' and Adam states' device
    memory (pinned host copies), onload restores it, and training continues bitwise; `forward`
    matches the CPU reference."""
    from fsdp_cases import VOCAB
    from protocol_reference import packed_batches, reference_token_outputs

    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", 0)

    def engine() -> FSDPEngine:
        return FSDPEngine(
            tiny_model(), device=device, dtype=torch.float32, optimizer_dtype=torch.float32, optim=SETTINGS
        )

    batches = packed_batches(VOCAB, num_micro_batches=2, seed=1)
    tokens = sum(mb.num_loss_tokens for mb in batches)
    offloaded, plain = engine(), engine()
    for e in (offloaded, plain):
        e.train_batch(batches, global_num_loss_tokens=tokens)
    state_bytes = sum(p.nbytes * 4 for p in offloaded.model.parameters())  # param, grad, exp_avg, exp_avg_sq
    before = torch.cuda.memory_allocated(device)
    offloaded.offload()
    assert torch.cuda.memory_allocated(device) <= before - state_bytes
    offloaded.onload()
    assert torch.cuda.memory_allocated(device) == before
    for e in (offloaded, plain):
        e.train_batch(batches, global_num_loss_tokens=tokens)
    got, want = dict(offloaded.named_weights(torch.float32)), dict(plain.named_weights(torch.float32))
    for name in want:
        assert torch.equal(got[name], want[name]), name
    ref = tiny_model()
    ref.load_state_dict({k: v.cpu() for k, v in want.items()})
    for out, batch in zip(plain.forward(batches), batches):
        expected = reference_token_outputs(ref, batch)
        for key in ("logprobs", "entropy"):
            torch.testing.assert_close(out[key], expected[key], rtol=1e-4, atol=1e-4, msg=key)
