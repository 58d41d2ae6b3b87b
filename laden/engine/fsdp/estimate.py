"""The fsdp engine's training-step memory: model states (exact, at their dtypes and shardings) and
activations under the recompute policy (an estimate, matched to peaks measured on an H200)."""

from __future__ import annotations

import math
from typing import Any

from laden.engine.estimates import (
    Component,
    ModelShapes,
    PhaseEstimate,
    checkpoint_pages,
    layer_activations,
    master_dtype,
    meta_model,
    nbytes,
    state_keys,
    tokens_per_microbatch,
)

WIDENED = 3
"""Hidden-width values per token a decoder layer saves in fp32 under autocast rather than in the
compute dtype (the residual stream's: the layer's input, the residual after attention, the
output), with the patches `laden sft` applies; matched to the fsdp:d1 peaks measured on an H200
(`benchmarks/plan_accuracy.py`)."""


def fsdp_activation_bytes(
    model: Any, cfg: Any, shapes: ModelShapes, tokens: int, *, autocast: bool
) -> dict[str, int]:
    """The fsdp step's activation peak of one micro-batch, by part (an estimate).

    Without recompute every decoder layer keeps what it saves; with `actor.gradient_checkpointing`
    each keeps its input and one layer at a time recomputes the rest. Under autocast (`fsdp:d1`
    with fp32 masters) the residual stream stays fp32 (4 bytes for `WIDENED` of the hidden-width
    values a layer saves, not the compute dtype's) and each linear saves its weight's compute-dtype cast:
    every decoder layer's without recompute, one layer's with. On top: the embedding's output, the
    head's kept tensors, and the largest transient of one step (a layer's backward, the loss's
    chunk, the embedding's dense gradient)."""
    pairs = layer_activations(model, cfg, tokens)
    (embed_kept, embed_tmp), decoders, (head_kept, head_tmp) = pairs[0], pairs[1:-1], pairs[-1]
    b = nbytes(cfg.actor.dtype)
    widen = tokens * WIDENED * shapes.hidden_size * (4 - b) if autocast else 0
    boundary = tokens * shapes.hidden_size * (4 if autocast else b)
    layer_weights = shapes.layer_params * b if autocast else 0
    if cfg.actor.gradient_checkpointing:
        layers = len(decoders) * boundary + max(k for k, _ in decoders) + widen + layer_weights
    else:
        layers = sum(k for k, _ in decoders) + len(decoders) * (widen + layer_weights)
    transient = max(max(t for _, t in decoders) + widen, head_tmp, embed_tmp)
    return {
        "decoder layers": layers,
        "embedding and head": embed_kept + head_kept,
        "largest transient": transient,
    }


class FsdpTraining:
    """The fsdp engine's training step on one rank (`actor.backend: fsdp:dN[tM][cK]`)."""

    def __init__(self, model: Any = None) -> None:
        self.model = model
        """`actor.path`'s model on the meta device (`meta_model`), if the caller built it already."""

    def estimate(self, cfg: Any, shapes: ModelShapes) -> PhaseEstimate:
        from laden.engine.backend import resolve_backend

        mode = resolve_backend(cfg).mode
        model = self.model if self.model is not None else meta_model(cfg.actor.path)
        shards = mode.dp * mode.cp * mode.tp
        master = master_dtype(cfg).itemsize
        n = shapes.num_params
        sharded = lambda per_param: math.ceil(n / shards) * per_param  # noqa: E731
        where = "host" if cfg.actor.fsdp.offload_params else "gpu"
        states = state_keys(cfg) * master
        parts = [
            Component("parameters (master)", **{where: sharded(master)}),
            Component("gradients", **{where: sharded(master)}),
            Component(f"optimizer states ({cfg.actor.optimizer.type})", **{where: sharded(states)}),
        ]
        if where == "gpu" and not (shards > 1 and cfg.actor.fsdp.memory_efficient_load):
            # the model is read (or initialised) on the host whole before the engine moves it
            loaded = n * nbytes(cfg.actor.optimizer_dtype)
            parts.append(
                Component(
                    "host: the model as loaded, before it moves to the GPU", host=loaded, load_time=True
                )
            )
            parts += checkpoint_pages(cfg)
        tokens = tokens_per_microbatch(cfg)
        compute = nbytes(cfg.actor.dtype)
        distributed = shards > 1
        autocast = not distributed and compute != master
        if distributed:  # unsharded compute-dtype copies of a layer and the next
            biggest = max(shapes.layer_params, shapes.embed_params, shapes.head_params)
            parts.append(Component("gathered layers (this and the prefetched next)", gpu=2 * biggest * compute // mode.tp, exact=False))  # fmt: skip
        act_tokens = math.ceil(tokens / mode.cp)
        recompute = " (recompute)" if cfg.actor.gradient_checkpointing else ""
        acts = fsdp_activation_bytes(model, cfg, shapes, act_tokens, autocast=autocast)
        total = sum(acts.values()) // mode.tp
        if where == "gpu":
            # gradients are set to None after each step and filled by backward as it frees the
            # activations it walks: the step peaks at the larger of the two, not at their sum. The
            # first gradient is the head's (the embedding's when tied), landed in the master dtype
            # while every activation is still alive.
            head = math.ceil((shapes.head_params or shapes.embed_params) / shards) * master
            total = max(0, total + head - parts[1].gpu)
        parts.append(Component(f"activations above the gradients{recompute}", gpu=total, exact=False))
        return PhaseEstimate("training", f"fsdp ({cfg.actor.backend})", parts)


class FsdpFrozen:
    """A never-stepped model on the fsdp engine (`laden.rl.scoring.frozen_engine`): its weights at the
    never-stepped config's storage dtype, sharded as the policy's are, where the policy's parameters live
    (the host under `actor.fsdp.offload_params`); no gradients (no backward runs) and no optimizer state.
    Its forwards' activations come and go before the policy's step and are not counted."""

    def __init__(self, model: Any = None) -> None:
        self.model = model

    def estimate(self, cfg: Any, shapes: ModelShapes) -> PhaseEstimate:
        from laden.engine.backend import resolve_backend

        mode = resolve_backend(cfg).mode
        shards = mode.dp * mode.cp * mode.tp
        dtype = master_dtype(cfg)
        offloaded = cfg.actor.fsdp.offload_params
        weights = math.ceil(shapes.num_params / shards) * dtype.itemsize
        name = f"weights ({str(dtype).removeprefix('torch.')})"
        parts = [Component(name, gpu=0 if offloaded else weights, host=weights if offloaded else 0)]
        if not offloaded and not (shards > 1 and cfg.actor.fsdp.memory_efficient_load):
            loaded = Component(
                "host: the model as loaded", host=shapes.num_params * dtype.itemsize, load_time=True
            )
            parts += [loaded, *checkpoint_pages(cfg)]
        return PhaseEstimate("frozen", f"fsdp ({cfg.actor.backend})", parts)
