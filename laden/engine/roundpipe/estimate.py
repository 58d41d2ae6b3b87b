"""The roundpipe engine's training-step memory: its host store (exact, `roundpipe.host.memory`) and the
two stages the GPU holds at a time."""

from __future__ import annotations

from typing import Any

import torch

from laden.engine.estimates import (
    Component,
    ModelShapes,
    PhaseEstimate,
    checkpoint_pages,
    loss_chunk_tokens,
    meta_model,
    tokens_per_microbatch,
)


class RoundPipeTraining:
    """The roundpipe engine: model states in host memory (exact, `roundpipe.host.memory`), the GPU
    holding two stages at a time under `actor.roundpipe.model_memory_limit`."""

    def __init__(self, model: Any = None, gpu_capacity: int | None = None) -> None:
        self.model = model
        """`actor.path`'s model on the meta device (`meta_model`), if the caller built it already."""
        self.gpu_capacity = gpu_capacity
        """The GPU's bytes: without `model_memory_limit` the engine plans for 60% of them."""

    def estimate(self, cfg: Any, shapes: ModelShapes) -> PhaseEstimate:
        from laden.engine.roundpipe.host.memory import predict_engine_gpu_bytes, predict_engine_host_bytes
        from laden.model.dtypes import torch_dtype
        from laden.optim import OptimSettings

        rp = cfg.actor.roundpipe
        model = self.model if self.model is not None else meta_model(cfg.actor.path)
        tokens = tokens_per_microbatch(cfg)
        limit = rp.model_memory_limit
        by_kind = predict_engine_host_bytes(
            model, optim=OptimSettings.from_config(cfg.actor.optimizer, 1), compute_dtype=torch_dtype(cfg.actor.dtype),
            optimizer_dtype=torch_dtype(cfg.actor.optimizer_dtype), pin_model=rp.pin_model, optim_step=rp.optim_step,
            pinned=torch.cuda.is_available(), recompute_grain=rp.recompute_grain, num_microbatches=rp.num_microbatch or 1,
            max_tokens_per_mb=tokens, model_memory_limit=limit,
        )  # fmt: skip
        parts = [
            Component(f"host: {kind}", host=b, exact=kind != "activations")
            for kind, b in by_kind.items()
            if b
        ]
        parts += checkpoint_pages(cfg)
        gpu, plan = predict_engine_gpu_bytes(
            model, optim=OptimSettings.from_config(cfg.actor.optimizer, 1), compute_dtype=torch_dtype(cfg.actor.dtype),
            optimizer_dtype=torch_dtype(cfg.actor.optimizer_dtype), recompute_grain=rp.recompute_grain,
            max_tokens_per_mb=tokens, model_memory_limit=limit, gpu_capacity=self.gpu_capacity,
            loss_chunk_size=loss_chunk_tokens(cfg, tokens),
        )  # fmt: skip
        stages = f"{len(plan.fwd_plan)} forward + {len(plan.bwd_plan)} backward stages"
        parts.append(
            Component(
                f"two stages resident: weights, gradients, activations ({stages})", gpu=gpu, exact=False
            )
        )
        return PhaseEstimate("training", f"roundpipe ({cfg.actor.backend})", parts)


FROZEN_KINDS = ("weights", "weights_stale", "master", "buffers", "pinned_rounding")
"""The host store's kinds a never-stepped model holds: its gradient inboxes are allocated at its first
backward, which never runs (the never-stepped config steps synchronously: no second inbox at build)."""


class RoundPipeFrozen:
    """A never-stepped model on the roundpipe engine (`laden.rl.scoring.frozen_engine`): its host store's
    weights (exact, `roundpipe.host.memory`); the GPU holds its stages only while it scores, before the
    policy's step."""

    def __init__(self, model: Any = None) -> None:
        self.model = model

    def estimate(self, cfg: Any, shapes: ModelShapes) -> PhaseEstimate:
        from laden.engine.roundpipe.host.memory import predict_engine_host_bytes
        from laden.model.dtypes import torch_dtype
        from laden.optim import OptimSettings

        rp = cfg.actor.roundpipe
        model = self.model if self.model is not None else meta_model(cfg.actor.path)
        by_kind = predict_engine_host_bytes(
            model, optim=OptimSettings.from_config(cfg.actor.optimizer, 1), compute_dtype=torch_dtype(cfg.actor.dtype),
            optimizer_dtype=torch_dtype(cfg.actor.optimizer_dtype), pin_model=rp.pin_model, optim_step=rp.optim_step,
            pinned=torch.cuda.is_available(),
        )  # fmt: skip
        parts = [
            Component(f"host: {kind}", host=b) for kind, b in by_kind.items() if b and kind in FROZEN_KINDS
        ]
        return PhaseEstimate("frozen", f"roundpipe ({cfg.actor.backend})", parts + checkpoint_pages(cfg))
