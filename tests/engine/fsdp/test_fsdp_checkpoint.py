"""Distributed checkpoints resharded across data-parallel sizes, and the gathered Hugging Face export."""

from __future__ import annotations

import torch
from fsdp_cases import SETTINGS, STEPS, full_params, run_engine, split_steps, tiny_model
from torch.distributed.tensor import DTensor
from workers import run_workers

from laden.engine.fsdp import FSDPEngine
from laden.engine.fsdp.checkpoint import load_dcp, save_dcp


def make_engine(world_size: int, **options) -> FSDPEngine:
    return FSDPEngine(
        tiny_model(),
        dp=world_size,
        dtype=torch.float32,
        optimizer_dtype=torch.float32,
        optim=SETTINGS,
        **options,
    )


def save_checkpoint(engine: FSDPEngine, path) -> None:
    """A resharding distributed checkpoint of the engine's state (all ranks call it)."""
    save_dcp(engine.state_dict(), path)


def load_checkpoint(engine: FSDPEngine, path) -> None:
    """Fill the engine's state template from `path` (any data-parallel size), then load it."""
    state = engine.state_dict()
    load_dcp(state, path)
    engine.load_state_dict(state)


def full_optimizer_state(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    """`fqn/key -> full tensor` of the optimizer state, gathered (every rank must call it)."""
    state = engine.state_dict()["optimizer"]["state"]
    out = {}
    for fqn, entry in state.items():
        for key, value in entry.items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            out[f"{fqn}/{key}"] = full.detach().clone().float()
    return out


def snapshot(engine: FSDPEngine):
    return full_params(engine.model), full_optimizer_state(engine), engine.scheduler.state_dict()


def _save_worker(rank: int, world_size: int, path: str, hf_dir: str, options: dict):
    engine = make_engine(world_size, **options)
    run_engine(engine, split_steps(STEPS[:1], world_size))
    save_checkpoint(engine, path)
    engine.export_hf(hf_dir)
    return snapshot(engine)


def _load_worker(rank: int, world_size: int, path: str, options: dict):
    engine = make_engine(world_size, **options)
    load_checkpoint(engine, path)
    before = snapshot(engine)
    run_engine(engine, split_steps(STEPS[1:], world_size))
    return before, full_params(engine.model)


def assert_same_state(got, want):
    got_params, got_optim, got_sched = got
    want_params, want_optim, want_sched = want
    assert got_params.keys() == want_params.keys() and got_optim.keys() == want_optim.keys()
    for name in want_params:
        torch.testing.assert_close(got_params[name], want_params[name], rtol=0, atol=0, msg=name)
    for name in want_optim:
        torch.testing.assert_close(got_optim[name], want_optim[name], rtol=0, atol=0, msg=name)
    assert got_sched["last_epoch"] == want_sched["last_epoch"]


def test_save_d2_resume_d1_and_export(tmp_path):
    """Saved by two ranks, loaded by one plain process: same params, Adam states and schedule;
    the next step equals the next step of an uninterrupted d1 run. The HF export loads back."""
    saved = run_workers(_save_worker, 2, str(tmp_path / "ckpt"), str(tmp_path / "hf"), {})[0]
    engine = make_engine(1)
    load_checkpoint(engine, tmp_path / "ckpt")
    assert_same_state(snapshot(engine), saved)

    run_engine(engine, split_steps(STEPS[1:], 1))
    uninterrupted = make_engine(1)
    run_engine(uninterrupted, split_steps(STEPS, 1))
    for name, want in full_params(uninterrupted.model).items():
        torch.testing.assert_close(full_params(engine.model)[name], want, rtol=1e-5, atol=1e-6, msg=name)

    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    for name, want in saved[0].items():
        torch.testing.assert_close(exported.state_dict()[name], want, rtol=0, atol=0, msg=name)


def test_save_d1_resume_d2_with_per_layer_optimizer(tmp_path):
    """The host-state optimizer (per-layer step) reshards too: saved by one process, loaded by two."""
    options = {"per_layer_optim_step": True}
    engine = make_engine(1, **options)
    run_engine(engine, split_steps(STEPS[:1], 1))
    save_checkpoint(engine, tmp_path / "ckpt")
    saved = snapshot(engine)
    results = run_workers(_load_worker, 2, str(tmp_path / "ckpt"), options)
    run_engine(engine, split_steps(STEPS[1:], 1))
    for before, after in results:
        assert_same_state(before, saved)
        for name, want in full_params(engine.model).items():
            torch.testing.assert_close(after[name], want, rtol=1e-5, atol=1e-6, msg=name)


def test_export_single_process_writes_bounded_shards(tmp_path):
    from laden.model.hf.export import export_hf

    model = tiny_model()
    engine = make_engine(1)
    weights = engine.named_weights(torch.bfloat16)
    export_hf(engine.model, tmp_path, dtype=torch.bfloat16, max_shard_size_bytes=64 * 1024, weights=weights)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for name, want in model.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], want.to(torch.bfloat16).float(), msg=name)
