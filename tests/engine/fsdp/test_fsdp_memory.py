"""Memory knobs of the fsdp engine are exact: offload_params, per_layer_optim_step, memory_efficient_load."""

from __future__ import annotations

import torch
from fsdp_cases import (
    SETTINGS,
    STEPS,
    VOCAB,
    full_params,
    reference_steps,
    run_engine,
    split_steps,
    tiny_model,
)
from tiny import tiny_qwen3_config
from workers import run_workers

from laden.engine.fsdp import FSDPEngine
from laden.engine.fsdp.load import build_meta_model
from laden.optim import OptimSettings
from laden.optim.sharded_adam import ShardedAdamW

OPTIM_VARIANTS = [
    {"offload_params": True},
    {"per_layer_optim_step": True, "optim_step_prefetch_layers": 1},
    {"per_layer_optim_step": True, "offload_params": True, "optim_step_prefetch_layers": 2},
]


def _optim_worker(rank: int, world_size: int, optimizers: list[str]):
    return [
        _optim_variants(world_size, OptimSettings(**{**_fields(SETTINGS), "type": o})) for o in optimizers
    ]


def _optim_variants(world_size: int, settings: OptimSettings):
    out = []
    for options in [{}, *OPTIM_VARIANTS]:
        engine = FSDPEngine(
            tiny_model(),
            dp=world_size,
            dtype=torch.float32,
            optimizer_dtype=torch.float32,
            optim=settings,
            **options,
        )
        metrics, _, params = run_engine(engine, split_steps(STEPS, world_size))
        opt = engine.optimizer
        states_on_host = isinstance(opt, ShardedAdamW) and all(
            t.device.type == "cpu" for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
        )
        params_on_host = all(p.to_local().device.type == "cpu" for p in engine.model.parameters())
        out.append((metrics, params, states_on_host, params_on_host))
    return out


def test_offload_and_per_layer_step_equal_ordinary_step():
    """d2, adam and adam_bf16: the host AdamW on offloaded shards and the per-layer streamed
    step (with and without offloaded params) give the parameters of the ordinary step."""
    optimizers = ["adam", "adam_bf16"]
    for per_rank in run_workers(_optim_worker, 2, optimizers):
        for optimizer, ((ref_metrics, ref_params, _, _), *variants) in zip(optimizers, per_rank):
            for options, (metrics, params, states_on_host, params_on_host) in zip(OPTIM_VARIANTS, variants):
                assert states_on_host, options
                # On a CPU machine "offloaded" only means FSDP's offload policy is active.
                assert params_on_host
                torch.testing.assert_close([m["loss"] for m in metrics], [m["loss"] for m in ref_metrics])
                exact = optimizer == "adam_bf16"  # the same Kahan math on both paths
                tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-7}
                for name, want in ref_params.items():
                    torch.testing.assert_close(params[name], want, **tol, msg=f"{optimizer} {options} {name}")


def _fields(settings: OptimSettings) -> dict:
    return {name: getattr(settings, name) for name in settings.__slots__}


def test_per_layer_step_single_process_matches_torch_adamw():
    """One plain process (no FSDP): the streamed step equals torch.optim.AdamW on the same grads."""
    engine = FSDPEngine(
        tiny_model(),
        dtype=torch.float32,
        optimizer_dtype=torch.float32,
        optim=SETTINGS,
        per_layer_optim_step=True,
    )
    metrics, _, params = run_engine(engine, split_steps(STEPS, 1))
    ref_losses, _, _, ref_params = reference_steps(tiny_model(), STEPS, SETTINGS)
    torch.testing.assert_close([m["loss"] for m in metrics], ref_losses, rtol=1e-5, atol=1e-6)
    for name, want in ref_params.items():
        torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-6, msg=name)


def _load_worker(rank: int, world_size: int, config_dir: str):
    return [_load_one(rank, world_size, config_dir, axis) for axis in ("dp", "tp")]


def _load_one(rank: int, world_size: int, config_dir: str, axis: str):
    # Rank 0 holds the checkpoint; the other ranks only a skeleton without weights.
    model = tiny_model() if rank == 0 else build_meta_model(config_dir, dtype=torch.float32)
    if rank > 0:
        assert all(p.is_meta for p in model.parameters())
    engine = FSDPEngine(
        model,
        **{axis: world_size},
        dtype=torch.float32,
        optimizer_dtype=torch.float32,
        optim=SETTINGS,
        memory_efficient_load=True,
    )
    loaded = full_params(engine.model)
    buffers = {n: b.clone() for n, b in engine.model.named_buffers()}
    metrics, _, _ = run_engine(engine, split_steps(STEPS[:1], engine.dp_size))
    return loaded, buffers, metrics


def test_memory_efficient_load_equals_checkpoint(tmp_path):
    """d2 and t2: weights broadcast from rank 0 into meta skeletons equal the checkpoint, and train."""
    tiny_qwen3_config(vocab_size=VOCAB).save_pretrained(tmp_path)
    results = [r for per_rank in run_workers(_load_worker, 2, str(tmp_path)) for r in per_rank]
    want = tiny_model()
    ref_losses, *_ = reference_steps(tiny_model(), STEPS[:1], SETTINGS)
    for loaded, buffers, metrics in results:
        for name, value in want.named_parameters():
            torch.testing.assert_close(loaded[name], value.detach(), rtol=0, atol=0, msg=name)
        for name, value in want.named_buffers():
            torch.testing.assert_close(buffers[name], value, rtol=0, atol=0, msg=name)
        torch.testing.assert_close([m["loss"] for m in metrics], ref_losses, rtol=1e-5, atol=1e-6)
