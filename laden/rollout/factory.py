"""`rollout.backend` to a running `RolloutEngine`: the native engine in this process, or servers.

`build_rollout_engine(cfg, ...)` reads the fields the OOM guide names: `rollout.backend`,
`rollout.max_concurrent_rollouts` (or the top-level `max_concurrent_rollouts`),
`native.mem_fraction_static`, `sglang.mem_fraction_static`, and `seed`; the context length
is the prompt budget (`train_dataset.max_length`) plus `gconfig.max_new_tokens`. Each native
engine of a `native:dN` run samples with `seed` plus its index (`rank // M`): the N engines
generate different shares of a batch, and one seed would give their rows the same random draws.

`native:dNtM` runs under torchrun with N*M processes: N engines of M consecutive ranks, each a
tensor parallel engine (`laden.rollout.native.tensor_parallel`); its weights are sharded on the
host before they move to the GPU, so no rank holds the whole model on its device.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from laden.config.alloc import AllocationMode, check_alloc

if TYPE_CHECKING:
    from laden.config.schema import LadenConfig
    from laden.rollout.base import RolloutEngine

log = logging.getLogger(__name__)

DEFAULT_MAX_CONCURRENT = 256


def max_concurrent_rollouts(cfg: LadenConfig) -> int:
    """`rollout.max_concurrent_rollouts`, its top-level alias, or the default (256)."""
    return cfg.rollout.max_concurrent_rollouts or cfg.max_concurrent_rollouts or DEFAULT_MAX_CONCURRENT


def build_rollout_engine(
    cfg: LadenConfig,
    *,
    model: Any = None,
    tokenizer: Any = None,
    model_dir: str | Path | None = None,
    device: Any = None,
    **kwargs: Any,
) -> RolloutEngine:
    """The engine `cfg.rollout.backend` names.

    native: `model` (a causal LM, moved to `device` in the actor's dtype) or loaded from
    `model_dir` / `actor.path`; servers: started on `model_dir` / `actor.path`. `kwargs` go to
    the engine (e.g. `kv_cache_tokens`, `cuda_graphs`).
    """
    errors = check_alloc(cfg.rollout.backend, role="rollout", field="rollout.backend")
    if errors:
        raise ValueError("; ".join(errors))
    mode = AllocationMode.parse(cfg.rollout.backend)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if mode.backend == "native" and mode.dp * mode.tp != world:
        n = mode.dp * mode.tp
        per = (
            "one copy per process" if mode.tp == 1 else f"each copy on {mode.tp} processes (tensor parallel)"
        )
        raise ValueError(
            f"rollout.backend={cfg.rollout.backend!r}: the native engine runs {per}, and this run has {world} "
            f"process(es); launch {n} (torchrun --nproc-per-node {n}) or set rollout.backend: native:d{world}"
        )
    path = Path(model_dir or cfg.actor.path) if (model_dir or cfg.actor.path) else None
    if mode.backend == "native":
        import torch

        from laden.model.dtypes import torch_dtype
        from laden.rollout.native import NativeEngine

        dtype = torch_dtype(cfg.actor.dtype)
        tp = None
        if mode.tp > 1:
            from laden.engine.fsdp.launch import init_distributed
            from laden.rollout.native.tensor_parallel import tensor_parallel_groups

            _, _, _, local = init_distributed()
            device = device or local
            tp = tensor_parallel_groups(mode.tp)
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if model is None:
            if path is None:
                raise ValueError("the native engine needs a model: set actor.path (or pass model=)")
            from laden.model.hf.loading import load_causal_lm

            model = load_causal_lm(
                str(path), dtype=dtype, init_from_config=cfg.actor.init_from_config, seed=cfg.seed
            )
        if tokenizer is None and path is not None:
            tokenizer = _tokenizer_or_none(path, without="requests with stop strings are refused")
        if tp is not None:  # on the host: the device never holds the whole model
            from laden.rollout.native.tensor_parallel import ShardLayout

            ShardLayout(model.config, rank=tp.rank, size=tp.size).shard_model(model)
        model = model.to(device=dev, dtype=dtype)
        kwargs.setdefault("max_model_len", cfg.train_dataset.max_length + cfg.gconfig.max_new_tokens)
        engine_index = int(os.environ.get("RANK", "0")) // mode.tp  # its M ranks share one sampler
        return NativeEngine(
            model, tokenizer, max_concurrent=max_concurrent_rollouts(cfg),
            mem_fraction_static=cfg.native.mem_fraction_static, seed=cfg.seed + engine_index, tensor_parallel=tp,
            **kwargs,
        )  # fmt: skip
    from laden.rollout.servers import start_server_engine

    if path is None:
        raise ValueError(f"rollout.backend={cfg.rollout.backend!r} needs a model directory: set actor.path")
    kwargs.setdefault("max_concurrent_requests", max_concurrent_rollouts(cfg))
    if tokenizer is None:
        tokenizer = _tokenizer_or_none(path, without="stop strings split by a pause will not be found")
    kwargs.setdefault("tokenizer", tokenizer)
    return start_server_engine(mode, model_dir=path, cfg=cfg, **kwargs)


def _tokenizer_or_none(path: Path, *, without: str) -> Any:
    """The tokenizer of the model directory (or .gguf file) the engine serves, which it matches stop
    strings with, or None (with a warning that says `without` it) where there is none. `load_tokenizer`
    refuses a directory with no vocabulary files, where transformers would build an empty tokenizer
    from config.json alone and stop strings would silently never match."""
    from laden.model.hf.loading import load_tokenizer

    try:
        return load_tokenizer(str(path))
    except (ValueError, ImportError) as err:  # ImportError: a .gguf without the gguf package
        log.warning("no tokenizer in %s (%s): %s", path, err, without)
        return None


def native_engine_from_weights(
    cfg: LadenConfig, named_weights: Any, *, device: Any, tokenizer: Any = None, version: int = 0
) -> Any:
    """The native engine on `device` with its own copy of the policy in `actor.dtype`, filled from
    `named_weights` (a trainer's `named_weights()`): built on a zero skeleton of `actor.path`, so the
    weights are neither read twice nor initialised at random. Its CUDA graphs and kernels are made on
    `device`."""
    import contextlib

    import torch

    from laden.model.dtypes import torch_dtype
    from laden.model.hf.loading import skeleton_causal_lm

    device = torch.device(device)
    copy = skeleton_causal_lm(cfg.actor.path, dtype=torch_dtype(cfg.actor.dtype), device=device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        engine: Any = build_rollout_engine(cfg, model=copy, tokenizer=tokenizer, device=device)
    engine.load_weights(named_weights, version=version)
    return engine
