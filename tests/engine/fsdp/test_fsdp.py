"""FSDPEngine on CPU with gloo: d2 == d1 == a plain PyTorch reference, single-process use, launcher."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fsdp_cases import (
    SETTINGS,
    STEPS,
    check_against_reference,
    packed,
    reference_steps,
    run_engine,
    split_steps,
    tiny_model,
)
from workers import run_workers

from laden.engine.fsdp import FSDPEngine
from laden.engine.parallel.launch import build_device_mesh, init_distributed

DP_VARIANTS = [
    {"dtype": torch.float32},
    {"dtype": torch.float32, "gradient_checkpointing": True},
    {"dtype": torch.bfloat16},  # bf16 compute (FSDP mixed precision), fp32 master weights
]


def _dp_worker(rank: int, world_size: int):
    results = []
    for options in DP_VARIANTS:
        engine = FSDPEngine(
            tiny_model(), dp=world_size, optimizer_dtype=torch.float32, optim=SETTINGS, **options
        )
        results.append(run_engine(engine, split_steps(STEPS, world_size)))
    return results, _mesh_checks()


def _mesh_checks():
    got = init_distributed()  # reuses the started group
    mesh = build_device_mesh(1, 2, 1, "cpu")
    errors = []
    try:
        build_device_mesh(4, 1, 1, "cpu")
    except ValueError as err:
        errors.append(str(err))
    return got[:3], mesh.size("tp"), mesh.size("dp_cp"), mesh.local_rank("tp"), errors


def test_d2_equals_d1_and_reference():
    """Two data-parallel ranks with unequal micro-batch counts train exactly like one process,
    with and without gradient checkpointing; bf16 compute stays close to the fp32 reference.
    (The same spawn checks the launcher and the mesh helper: process start-up is the cost.)"""
    per_rank, mesh_checks = zip(*run_workers(_dp_worker, 2))
    check_against_reference([r[0] for r in per_rank])
    check_against_reference([r[1] for r in per_rank])
    ref_losses, ref_norms, *_ = reference_steps(tiny_model(), STEPS, SETTINGS)
    for r in per_rank:
        metrics = r[2][0]
        torch.testing.assert_close([m["loss"] for m in metrics], ref_losses, rtol=2e-2, atol=0)
        torch.testing.assert_close([m["grad_norm"] for m in metrics], ref_norms, rtol=5e-2, atol=0)
    for rank, (got, tp, shard, tp_rank, errors) in enumerate(mesh_checks):
        assert got == (rank, 2, rank)
        assert (tp, shard, tp_rank) == (2, 1, rank)
        assert errors and "d4 x c1 x t1 = 4 processes but 2 were started" in errors[0]


def test_single_process_without_process_group():
    engine = FSDPEngine(tiny_model(), dtype=torch.float32, optimizer_dtype=torch.float32, optim=SETTINGS)
    assert not engine.distributed
    check_against_reference([run_engine(engine, split_steps(STEPS, 1))])


def test_eval_batch_is_token_mean():
    model = tiny_model()
    engine = FSDPEngine(model, dtype=torch.float32, optimizer_dtype=torch.float32, optim=SETTINGS)
    docs = STEPS[0]
    mbs = [packed(docs[:3]), packed(docs[3:])]
    num_tokens = sum(mb.num_loss_tokens for mb in mbs)
    got = engine.eval_batch(mbs, global_num_loss_tokens=num_tokens)["loss"]
    ref_model = tiny_model()
    with torch.no_grad():
        ref = sum(
            F.cross_entropy(ref_model(input_ids=d[None]).logits[0, :-1], d[1:], reduction="sum") for d in docs
        )
    torch.testing.assert_close(got, ref / num_tokens)


def test_without_torchrun_nothing_is_started(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    rank, world_size, local_rank, device = init_distributed()
    assert (rank, world_size, local_rank) == (0, 1, 0)
    assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_multi_process_mode_without_process_group_is_rejected():
    with pytest.raises(ValueError, match="torchrun --nproc_per_node 2"):
        FSDPEngine(tiny_model(), dp=2, dtype=torch.float32, optim=SETTINGS)


def test_a_process_group_started_by_init_distributed_ends_at_exit(monkeypatch):
    """The group laden starts is destroyed by an exit hook (before C++ static destruction, where
    gloo's threads aborted a finished process now and then); a group started elsewhere is not
    laden's to end."""
    import socket

    import torch.distributed as dist

    from laden.engine.parallel import launch

    hooks: list = []
    monkeypatch.setattr(launch.atexit, "register", hooks.append)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port)).items():  # fmt: skip
        monkeypatch.setenv(key, value)
    try:
        assert init_distributed("gloo")[:2] == (0, 1) and dist.is_initialized()
        assert init_distributed("gloo")[:2] == (0, 1)  # reused: no second hook
        assert len(hooks) == 1
        hooks[0]()
        assert not dist.is_initialized()
        hooks[0]()  # at exit after someone else ended it: nothing to do
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
