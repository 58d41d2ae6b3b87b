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
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
    """The engine `cfg.rollout.backend` names (its backend object's `build`).

    native: `model` (a causal LM, moved to `device` in the actor's dtype) or loaded from
    `model_dir` / `actor.path`; servers: started on `model_dir` / `actor.path`. `kwargs` go to
    the engine (e.g. `kv_cache_tokens`, `cuda_graphs`).
    """
    from laden.rollout.backend import resolve_rollout

    backend = resolve_rollout(cfg)
    return backend.build(cfg, model=model, tokenizer=tokenizer, model_dir=model_dir, device=device, **kwargs)


def tokenizer_or_none(path: Path, *, without: str) -> Any:
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
