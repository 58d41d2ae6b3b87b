"""Predicted GPU and host peaks per phase (training, generation, weight update), per engine.

Each estimator answers for one phase of one engine from the config and a shapes-only model
(built on the meta device from `actor.path`'s config.json: no weights read, no memory taken),
as a list of named components with their GPU and host bytes on one rank. What is exact and
what is an estimate:

- exact (the bytes the engine allocates; tests compare them with a CPU run): model states,
  i.e. parameters, gradients, master weights and optimizer states at their dtypes and
  shardings (fsdp) and the roundpipe host store (`roundpipe.host.memory`); the native engine's
  KV cache for a given number of blocks; weight-update buckets.
- estimated (validated against measured peaks on a GPU, `benchmarks/RESULTS.md`): activations
  under the recompute policy, the loss's logits (chunked or whole), the gathered layers of
  FSDP, the sampler's logits, and the allocator's slack.

`MemoryEstimator` is the seam: an engine that wants `laden plan` to plan for it implements
`estimate(cfg, shapes)`. No estimator reaches into an engine's internals; they read the
config and the model's shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

GIB = 2**30


@dataclass(frozen=True, slots=True)
class Component:
    name: str
    gpu: int = 0
    host: int = 0
    exact: bool = True
    """Whether the bytes are what the engine allocates (else an estimate)."""


@dataclass(slots=True)
class PhaseEstimate:
    phase: str
    engine: str
    components: list[Component] = field(default_factory=list)

    @property
    def gpu(self) -> int:
        return sum(c.gpu for c in self.components)

    @property
    def host(self) -> int:
        return sum(c.host for c in self.components)

    @property
    def resident_gpu(self) -> int:
        """GPU bytes that stay between steps: the exact components (model states), not the step's transients."""
        return sum(c.gpu for c in self.components if c.exact)

    def largest(self, where: str) -> Component | None:
        """The component with the most bytes on `where` ("gpu" or "host")."""
        ranked = [c for c in self.components if getattr(c, where) > 0]
        return max(ranked, key=lambda c: getattr(c, where)) if ranked else None


@dataclass(frozen=True, slots=True)
class ModelShapes:
    """What the estimators need to know of a causal LM, read from a meta-device build."""

    num_params: int
    embed_params: int
    head_params: int  # 0 when tied to the embedding
    layer_params: int  # the largest decoder layer
    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied: bool

    @classmethod
    def from_model(cls, model: Any) -> ModelShapes:
        cfg = model.config
        layers = model.model.layers
        heads = int(cfg.num_attention_heads)
        head = model.get_output_embeddings().weight
        embed = model.get_input_embeddings().weight
        tied = head is embed
        return cls(
            num_params=sum(p.numel() for p in model.parameters()), embed_params=embed.numel(),
            head_params=0 if tied else head.numel(), layer_params=max(sum(p.numel() for p in m.parameters()) for m in layers),
            num_layers=len(layers), hidden_size=int(cfg.hidden_size),
            intermediate_size=int(getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size),
            vocab_size=int(cfg.vocab_size), num_heads=heads,
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads), tied=tied,
        )  # fmt: skip

    @classmethod
    def from_path(cls, path: str) -> ModelShapes:
        """From a model directory's config.json (a `.gguf` file's metadata is not read here)."""
        return cls.from_model(meta_model(path))


def host_memory_bytes() -> int | None:
    """This machine's physical memory, or None where the OS does not say."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def meta_model(path: str) -> Any:
    """`path`'s causal LM with every parameter on the meta device (shapes only)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def patched_meta_model(cfg: Any) -> Any:
    """`meta_model(actor.path)` with the model patches the run applies (`actor.lean_activations`,
    `actor.tiled_mlp_tokens`, ...), which change what each layer saves."""
    import logging

    from laden.engine.runtime import patch_model

    model = meta_model(cfg.actor.path)
    runtime_log = logging.getLogger("laden.runtime")
    level = runtime_log.level
    runtime_log.setLevel(logging.WARNING)  # the run logs what it patches; the plan does not repeat it
    try:
        patch_model(cfg, model)
    finally:
        runtime_log.setLevel(level)
    return model


class MemoryEstimator(Protocol):
    """One phase of one engine: its predicted components on one rank."""

    def estimate(self, cfg: Any, shapes: ModelShapes) -> PhaseEstimate: ...


def _nbytes(dtype_name: str) -> int:
    from laden.model.dtypes import torch_dtype

    return torch_dtype(dtype_name).itemsize


def master_dtype(cfg: Any) -> torch.dtype:
    """The master weights' dtype: bf16 for `adam_bf16`, else `actor.optimizer_dtype`."""
    from laden.model.dtypes import torch_dtype
    from laden.optim import OptimSettings

    return OptimSettings.from_config(cfg.actor.optimizer, 1).master_dtype(
        torch_dtype(cfg.actor.optimizer_dtype)
    )


def _state_keys(cfg: Any) -> int:
    """Per-parameter optimizer state tensors at the master dtype (Adam's two moments, ...)."""
    from laden.engine.roundpipe.host.memory import optimizer_state_keys

    opt = cfg.actor.optimizer
    return len(optimizer_state_keys(opt.type, getattr(opt, "momentum", 0.0)))


def longest_sequence(cfg: Any) -> int:
    """The longest sequence a micro-batch must hold: the prompt budget (plus `max_new_tokens` for RL)."""
    return cfg.train_dataset.max_length + (
        cfg.gconfig.max_new_tokens if cfg.train_dataset.type == "rl" else 0
    )


def tokens_per_microbatch(cfg: Any) -> int:
    """The largest micro-batch the trainer packs: the token budget, else one longest sequence."""
    return int(cfg.actor.mb_spec.max_tokens_per_mb or longest_sequence(cfg))


def checkpoint_pages(cfg: Any) -> list[Component]:
    """The checkpoint's safetensors files as read (memory-mapped, so their pages count in the resident
    set while the model loads); nothing for a random init (`actor.init_from_config`)."""
    from pathlib import Path

    path = Path(cfg.actor.path)
    if cfg.actor.init_from_config or not path.is_dir():
        return []
    nbytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return (
        [Component("host: the checkpoint's pages, memory-mapped while it loads", host=nbytes)]
        if nbytes
        else []
    )


def layer_activations(model: Any, cfg: Any, tokens: int) -> list[tuple[int, int]]:
    """Per pipeline step of `model` (embedding, decoder layers, head and loss): the (kept, transient)
    activation bytes of a `tokens` micro-batch, from `laden.model.split.activation_bytes` (checked
    against saved-tensor hooks there), at the compute dtype, with the loss's logits one chunk of
    `actor.loss_chunk_size` tokens under `actor.chunked_loss` and every token without."""
    from laden.model.dtypes import torch_dtype
    from laden.model.split import activation_bytes, split_causal_lm

    chunk = cfg.actor.loss_chunk_size if cfg.actor.chunked_loss else max(tokens, 1)
    dtype = torch_dtype(cfg.actor.dtype)
    return [
        activation_bytes(step, tokens, dtype=dtype, loss_chunk_size=chunk)
        for step in split_causal_lm(model).layers
    ]


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
    b = _nbytes(cfg.actor.dtype)
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
        from laden.config import AllocationMode

        mode = AllocationMode.parse(cfg.actor.backend)
        model = self.model if self.model is not None else meta_model(cfg.actor.path)
        shards = mode.dp * mode.cp * mode.tp
        master = master_dtype(cfg).itemsize
        n = shapes.num_params
        sharded = lambda per_param: math.ceil(n / shards) * per_param  # noqa: E731
        where = "host" if cfg.actor.fsdp.offload_params else "gpu"
        states = _state_keys(cfg) * master
        parts = [
            Component("parameters (master)", **{where: sharded(master)}),
            Component("gradients", **{where: sharded(master)}),
            Component(f"optimizer states ({cfg.actor.optimizer.type})", **{where: sharded(states)}),
        ]
        if where == "gpu" and not (shards > 1 and cfg.actor.fsdp.memory_efficient_load):
            # the model is read (or initialised) on the host whole before the engine moves it
            loaded = n * _nbytes(cfg.actor.optimizer_dtype)
            parts.append(Component("host: the model as loaded, before it moves to the GPU", host=loaded))
            parts += checkpoint_pages(cfg)
        tokens = tokens_per_microbatch(cfg)
        compute = _nbytes(cfg.actor.dtype)
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
            loss_chunk_size=cfg.actor.loss_chunk_size if cfg.actor.chunked_loss else tokens,
        )  # fmt: skip
        stages = f"{len(plan.fwd_plan)} forward + {len(plan.bwd_plan)} backward stages"
        parts.append(
            Component(
                f"two stages resident: weights, gradients, activations ({stages})", gpu=gpu, exact=False
            )
        )
        return PhaseEstimate("training", f"roundpipe ({cfg.actor.backend})", parts)


class NativeGeneration:
    """The embedded rollout engine: its weights, its paged KV cache and the sampler's logits."""

    def __init__(self, gpu_capacity: int | None = None, trainer_resident: int = 0) -> None:
        self.trainer_resident = trainer_resident
        """GPU bytes the trainer keeps on the engine's GPU while it generates (its model states,
        colocated); the engine's cache fills what `mem_fraction_static` leaves after them."""
        self.gpu_capacity = gpu_capacity
        """Bytes of the GPU planned for: the cache then fills `native.mem_fraction_static` of it after the
        weights and a profiling pass, as the engine sizes it on CUDA; None: the engine's CPU sizing."""

    def estimate(self, cfg: Any, shapes: ModelShapes) -> PhaseEstimate:
        from laden.model.dtypes import torch_dtype
        from laden.rollout.factory import max_concurrent_rollouts
        from laden.rollout.native.kv_cache import KVCache

        dtype = torch_dtype(cfg.actor.dtype)
        weights = shapes.num_params * dtype.itemsize
        concurrent = max_concurrent_rollouts(cfg)
        on_gpu = self.gpu_capacity is not None  # planning for a GPU: the engine's CUDA settings
        block = 32 if on_gpu else 16
        per_block = KVCache.bytes_per_block(
            num_layers=shapes.num_layers, block_size=block, kv_heads=shapes.num_kv_heads, head_dim=shapes.head_dim,
            dtype=dtype,
        )  # fmt: skip
        max_len = cfg.train_dataset.max_length + cfg.gconfig.max_new_tokens
        s = shapes
        # the engine's profiling pass: one layer's prefill tensors at its largest prefill batch
        prefill_tokens = 16384 if on_gpu else 2048
        widths = 4 * s.hidden_size + 3 * s.intermediate_size + (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        prefill = prefill_tokens * widths * dtype.itemsize
        parts = [Component(f"weights ({cfg.actor.dtype})", gpu=weights)]
        if self.trainer_resident:
            parts.insert(0, Component("the trainer's model states (same GPU)", gpu=self.trainer_resident))
        if self.gpu_capacity is not None:
            parts.append(
                Component(f"prefill activations ({prefill_tokens} tokens)", gpu=prefill, exact=False)
            )
            taken = weights + prefill + self.trainer_resident
            cache = max(0, int(cfg.native.mem_fraction_static * self.gpu_capacity) - taken)
            cache = cache // per_block * per_block
            how = f"mem_fraction_static={cfg.native.mem_fraction_static}"
        else:  # what every request in flight needs at its longest, as the engine sizes it off the GPU
            cache = (concurrent * (math.ceil(max_len / block) + 1) + 1) * per_block
            how = f"{concurrent} sequences x {max_len} tokens"
        sampler = 2 * concurrent * shapes.vocab_size * 4
        parts += [
            Component(f"KV cache ({how})", gpu=cache),
            Component("sampler logits", gpu=sampler, exact=False),
        ]
        return PhaseEstimate("generation", f"native ({cfg.rollout.backend})", parts)


class WeightUpdate:
    """Trainer to rollout engine: buckets of `actor.weight_chunked_mem_mb`, or a disk shard staged."""

    def estimate(self, cfg: Any, shapes: ModelShapes) -> PhaseEstimate:
        mode = cfg.actor.weight_update_mode
        bucket = cfg.actor.weight_chunked_mem_mb * 2**20
        if mode == "xccl" and cfg.rollout.backend.startswith("native:"):
            mode = "in place"  # the native engine in the trainer's process: no broadcast (`laden.rl`)
        if mode == "disk":
            parts = [Component("host staging of one shard", host=bucket)]
        elif mode == "xccl":
            parts = [Component("broadcast bucket (sender and receiver)", gpu=2 * bucket)]
        else:  # in place: a tensor at a time, copied into the engine's own storage
            biggest = max(shapes.embed_params, shapes.head_params, 1)
            parts = [
                Component(
                    "one tensor in the compute dtype", gpu=biggest * _nbytes(cfg.actor.dtype), exact=False
                )
            ]
        return PhaseEstimate("weight update", mode, parts)


def training_estimator(cfg: Any, model: Any = None, gpu_capacity: int | None = None) -> MemoryEstimator:
    """The estimator of `actor.backend`'s training step (`model`: its meta-device build, if made)."""
    from laden.config import AllocationMode

    backend = AllocationMode.parse(cfg.actor.backend).backend
    if backend == "roundpipe":
        return RoundPipeTraining(model, gpu_capacity)
    if backend == "fsdp":
        return FsdpTraining(model)
    raise ValueError(f"actor.backend={cfg.actor.backend!r}: laden plan has no estimator for {backend!r} yet")


def native_generation(
    cfg: Any, shapes: ModelShapes, training: PhaseEstimate, gpu_capacity: int | None
) -> PhaseEstimate:
    """The native engine's generation phase beside `training`'s resident bytes when both share the GPU
    (`cluster.n_gpus_per_node` < 2: the engine then runs on the trainer's GPU)."""
    resident = training.resident_gpu if cfg.cluster.n_gpus_per_node < 2 else 0
    return NativeGeneration(gpu_capacity, resident).estimate(cfg, shapes)


def plan_phases(cfg: Any, *, gpu_capacity: int | None, job: str) -> list[PhaseEstimate]:
    """Every phase `job` runs for `cfg`: training, and for `laden rl` generation and weight update."""
    model = patched_meta_model(cfg)
    shapes = ModelShapes.from_model(model)
    phases = [training_estimator(cfg, model, gpu_capacity).estimate(cfg, shapes)]
    if job == "rl" and cfg.rollout.backend.startswith("native:"):
        phases.append(native_generation(cfg, shapes, phases[0], gpu_capacity))
    if job == "rl":
        phases.append(WeightUpdate().estimate(cfg, shapes))
    return phases
