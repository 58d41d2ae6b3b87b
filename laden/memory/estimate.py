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

Without a GPU to plan for, the engines run on the CPU and every byte is host memory: `on_the_cpu`
moves each phase's GPU components to the host and adds the process's own baseline
(`PROCESS_BASELINE_BYTES`), so the figure is the process's peak resident set, which
`laden plan --profile` measures the same way (`laden.memory.profile`).

`MemoryEstimator` is the seam: an engine that wants `laden plan` to plan for it implements
`estimate(cfg, shapes)`. No estimator reaches into an engine's internals; they read the
config and the model's shapes.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from laden.engine.estimates import (
    GIB,
    Component,
    MemoryEstimator,
    ModelShapes,
    PhaseEstimate,
    host_memory_bytes,
    longest_sequence,
    meta_model,
    nbytes,
    sequences_per_sample,
    tokens_per_microbatch,
)
from laden.rollout.backend import resolve_rollout

__all__ = [
    "FROM_PROCESS_START", "GIB", "PROCESS_BASELINE_BYTES", "Component", "MemoryEstimator", "ModelShapes",
    "NativeGeneration", "PhaseEstimate", "WeightUpdate", "host_memory_bytes", "longest_sequence", "native_generation",
    "on_the_cpu", "patched_meta_model", "plan_phases", "sequences_per_sample", "tokens_per_microbatch",
    "training_estimator",
]  # fmt: skip


def patched_meta_model(cfg: Any) -> Any:
    """`meta_model(actor.path)` with the model patches the run applies (`actor.lean_activations`,
    `actor.tiled_mlp_tokens`, ...), which change what each layer saves; `laden rw`'s with its one-row head
    (`laden.model.value_head`), as `laden.align.task` builds it."""
    import logging

    from laden.engine.backend import resolve_backend
    from laden.engine.runtime import patch_model

    model = meta_model(cfg.actor.path)
    runtime_log = logging.getLogger("laden.runtime")
    level = runtime_log.level
    runtime_log.setLevel(logging.WARNING)  # the run logs what it patches; the plan does not repeat it
    try:
        patch_model(cfg, model, resolve_backend(cfg))
    finally:
        runtime_log.setLevel(level)
    if cfg.train_dataset.type == "rw":
        from laden.model.value_head import to_value_model

        model = to_value_model(model)
    return model


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
        # one layer's prefill tensors at the engine's largest prefill batch (its profiling pass on CUDA; on
        # the CPU every prefill of `max_prefill_tokens`, 2048 there)
        prefill_tokens = 16384 if on_gpu else 2048
        widths = 4 * s.hidden_size + 3 * s.intermediate_size + (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        prefill = prefill_tokens * widths * dtype.itemsize
        parts = [Component(f"weights ({cfg.actor.dtype})", gpu=weights)]
        if self.trainer_resident:
            where = "same GPU" if self.gpu_capacity is not None else "same process, on the CPU"
            parts.insert(0, Component(f"the trainer's model states ({where})", gpu=self.trainer_resident))
        parts.append(Component(f"prefill activations ({prefill_tokens} tokens)", gpu=prefill, exact=False))
        if self.gpu_capacity is not None:
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
    """Trainer to rollout engine: a disk shard staged on the host (`disk`), the native engine filled in place a
    tensor at a time (`xccl` in the trainer's process), or a bucket of `actor.weight_chunked_mem_mb` broadcast
    to servers (`xccl`; the servers' receiving buckets are on their own GPUs)."""

    def estimate(self, cfg: Any, shapes: ModelShapes) -> PhaseEstimate:
        mode = cfg.actor.weight_update_mode
        bucket = cfg.actor.weight_chunked_mem_mb * 2**20
        in_process = resolve_rollout(cfg).in_process
        if mode == "xccl" and in_process:
            mode = "in place"  # the native engine in the trainer's process: no broadcast (`laden.rl`)
        if mode == "disk":
            parts = [Component("host staging of one shard", host=bucket)]
        elif (
            mode == "xccl"
        ):  # to servers: whole tensors, a bigger one alone (`laden.rollout.servers.broadcast`)
            mode = "broadcast to servers"
            biggest = max(shapes.embed_params, shapes.head_params, 1) * nbytes(cfg.actor.dtype)
            parts = [
                Component(
                    "broadcast bucket of whole tensors (the servers hold theirs on their own GPUs)",
                    gpu=max(bucket, biggest),
                    exact=False,
                )
            ]
        else:  # in place: a tensor at a time, copied into the engine's own storage
            biggest = max(shapes.embed_params, shapes.head_params, 1)
            parts = [
                Component(
                    "one tensor in the compute dtype", gpu=biggest * nbytes(cfg.actor.dtype), exact=False
                )
            ]
        return PhaseEstimate("weight update", mode, parts)


def training_estimator(cfg: Any, model: Any = None, gpu_capacity: int | None = None) -> MemoryEstimator:
    """The estimator of `actor.backend`'s training step (`model`: its meta-device build, if made), as its
    backend object gives it; an engine without one is refused (`no_estimator`)."""
    from laden.engine.backend import resolve_backend

    backend = resolve_backend(cfg)
    estimator = backend.training_estimator(model, gpu_capacity)
    if estimator is None:
        raise ValueError(f"actor.backend={cfg.actor.backend!r}: {no_estimator(backend.name)}")
    return estimator


def no_estimator(engine: str) -> str:
    """What `laden plan` and the `auto` knobs say of an engine the planner has no memory model for."""
    return (
        f"laden plan has no memory estimator for the {engine} engine yet, so it cannot predict its peaks "
        "(the auto knobs take their memory-saving values: recompute on, one longest sequence per micro-batch)"
    )


def native_generation(
    cfg: Any, shapes: ModelShapes, training: PhaseEstimate, gpu_capacity: int | None
) -> PhaseEstimate:
    """The native engine's generation phase beside `training`'s resident bytes when both share the GPU
    (`cluster.n_gpus_per_node` < 2: the engine then runs on the trainer's GPU)."""
    resident = training.resident_gpu if cfg.cluster.n_gpus_per_node < 2 else 0
    return NativeGeneration(gpu_capacity, resident).estimate(cfg, shapes)


PROCESS_BASELINE_BYTES = 470 * 2**20
"""The resident set of a laden process before it builds a model (an estimate): the interpreter,
torch, transformers and a model class imported. Measured once with torch 2.13 (CPU build) and
transformers 5.24 on Linux x86_64: `import torch` 221 MiB, with transformers 245 MiB, with a
causal-LM class (which pulls in transformers' generation and integrations) 459 MiB, and 471 MiB
at the start of `laden plan --profile`'s training phase (`benchmarks/RESULTS.md`). A CUDA build
of torch maps more libraries; the GPU plan leaves the baseline out (its profile measures the host
above it)."""

FROM_PROCESS_START = frozenset({"training", "generation"})
"""Phases counted from the process's own baseline (the trainer's resident bytes included), as the
profile measures them; the weight update is counted above what is allocated when it starts."""


def on_the_cpu(phase: PhaseEstimate) -> PhaseEstimate:
    """`phase` with its engine on the CPU: what the estimator put on the GPU is host memory, the bytes
    held only while the model loads are left out (the step peaks above the load), and a phase counted
    from the process's start (`FROM_PROCESS_START`) adds the process's baseline."""
    parts = [replace(c, gpu=0, host=c.host + c.gpu) for c in phase.components if not c.load_time]
    if phase.phase in FROM_PROCESS_START:
        baseline = "process baseline: Python, torch, transformers"
        parts.insert(0, Component(baseline, host=PROCESS_BASELINE_BYTES, exact=False))
    return PhaseEstimate(phase.phase, f"{phase.engine} on the CPU", parts, on_cpu=True)


def plan_phases(cfg: Any, *, gpu_capacity: int | None, job: str) -> list[PhaseEstimate]:
    """Every phase `job` runs for `cfg`: training (the policy's step and, for `laden rl`, the models
    beside it: `laden.memory.companions`), and for `laden rl` generation and weight update. Without a GPU
    to plan for (`gpu_capacity` None) the engines run on the CPU (`on_the_cpu`)."""
    from laden.memory.companions import training_phase

    model = patched_meta_model(cfg)
    shapes = ModelShapes.from_model(model)
    phases = [training_phase(cfg, model, shapes, gpu_capacity, job)]
    if job == "rl" and resolve_rollout(cfg).in_process:
        phases.append(native_generation(cfg, shapes, phases[0], gpu_capacity))
    if job == "rl":
        phases.append(WeightUpdate().estimate(cfg, shapes))
    return phases if gpu_capacity is not None else [on_the_cpu(p) for p in phases]
