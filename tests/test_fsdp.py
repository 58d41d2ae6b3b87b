"""FSDPEngine on CPU with gloo: d2 == d1 == a plain PyTorch reference, single-process use, launcher."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_qwen3_config
from workers import run_workers

from laden.data.batch import pack_samples
from laden.engine.fsdp import FSDPEngine
from laden.engine.parallel.launch import build_device_mesh, init_distributed
from laden.optim import OptimSettings

VOCAB = 96
# eps 1e-3: Adam's update g / (|g| + eps) has slope up to lr / (4 eps) near |g| = eps, so with the
# default 1e-8 fp32 summation-order noise moves parameters by whole steps; 1e-3 bounds it to ~2.5x.
SETTINGS = OptimSettings(lr=1e-2, eps=1e-3, weight_decay=0.0, gradient_clipping=0.5, total_steps=10)


def tiny_model(seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_qwen3_config(vocab_size=VOCAB, **overrides)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def make_docs(num_docs: int, seed: int, min_len: int = 3, max_len: int = 12) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num_docs,), generator=g).tolist()
    return [torch.randint(4, VOCAB, (n,), generator=g) for n in lengths]


def packed(docs):
    return pack_samples([(d.tolist(), [1] * len(d)) for d in docs])


def full_params(model, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full (gathered) parameters, or their gradients, by name."""
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = full.detach().clone()
    return out


def reference_steps(model, steps: list[list[torch.Tensor]], settings: OptimSettings):
    """Plain PyTorch: per-document forward, token-mean CE over the step, clip, AdamW."""
    opt = torch.optim.AdamW(
        model.parameters(), lr=settings.lr, eps=settings.eps, weight_decay=0.0, betas=settings.betas
    )
    losses, norms = [], []
    for docs in steps:
        opt.zero_grad()
        num_tokens = sum(len(d) - 1 for d in docs)
        total = 0.0
        for d in docs:
            logits = model(input_ids=d[None]).logits[0, :-1]  # [L - 1, V]
            loss = F.cross_entropy(logits.float(), d[1:], reduction="sum") / num_tokens
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), settings.gradient_clipping).item())
        grads = full_params(model, grads=True)  # clipped, as the engine leaves them
        opt.step()
        losses.append(total)
    return losses, norms, grads, full_params(model)


def run_engine(engine, steps_per_rank: list[list[list]]):
    """Train on this data-parallel rank's micro-batches for every step; metrics, grads and params."""
    metrics = []
    for per_rank in steps_per_rank:
        total = sum(mb.num_loss_tokens for mbs in per_rank for mb in mbs)
        out = engine.train_batch(per_rank[engine.dp_rank], global_num_loss_tokens=total)
        metrics.append({k: float(v) for k, v in out.items()})
    return metrics, full_params(engine.model, grads=True), full_params(engine.model)


def split_steps(steps: list[list[torch.Tensor]], world_size: int):
    """Per step, per rank, a list of micro-batches; rank 0 gets one micro-batch more than the others."""
    out = []
    for docs in steps:
        ranks = [[] for _ in range(world_size)]
        chunks = [docs[i : i + 2] for i in range(0, len(docs), 2)]
        for i, chunk in enumerate(chunks):
            ranks[0 if i == 0 else i % world_size].append(packed(chunk))
        out.append(ranks)
    return out


STEPS = [make_docs(6, seed=1), make_docs(6, seed=2)]


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


def check_against_reference(results, model_fn=tiny_model, rtol=1e-4, atol=1e-5):
    """Losses, grad norms, last-step grads and updated params against the plain reference."""
    losses, norms, grads, params = reference_steps(model_fn(), STEPS, SETTINGS)
    for metrics, got_grads, got in results:
        torch.testing.assert_close([m["loss"] for m in metrics], losses, rtol=rtol, atol=atol)
        torch.testing.assert_close([m["grad_norm"] for m in metrics], norms, rtol=rtol, atol=atol)
        for name, ref in grads.items():
            torch.testing.assert_close(got_grads[name], ref, rtol=rtol, atol=atol, msg=f"grad {name}")
        for name, ref in params.items():
            torch.testing.assert_close(got[name], ref, rtol=rtol, atol=atol, msg=name)


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
