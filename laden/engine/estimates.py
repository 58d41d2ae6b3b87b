"""The byte vocabulary of memory estimates, which every engine's estimator and the planner speak.

An engine that wants `laden plan` and the `auto` knobs to plan for it gives its backend object
(`laden.engine.backend.TrainBackend.training_estimator`) a `MemoryEstimator`: `estimate(cfg, shapes)`
returns a `PhaseEstimate`, a list of named `Component`s with their GPU and host bytes on one rank,
each marked exact (the bytes the engine allocates) or estimated. The shapes come from a meta-device
build of the model (`ModelShapes`): no weights read, no memory taken. The planner that adds the
phases up and chooses knobs (`laden.memory`) sits above the engines; this module imports none of it.
"""

from __future__ import annotations

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
    load_time: bool = False
    """Host bytes held only while the model loads (the copy staged before it moves to the GPU, the
    checkpoint's mapped pages); an engine on the CPU trains that copy and its step peaks above the
    load, so they are not counted there (`laden.memory.estimate.on_the_cpu`)."""


@dataclass(slots=True)
class PhaseEstimate:
    phase: str
    engine: str
    components: list[Component] = field(default_factory=list)
    on_cpu: bool = False
    """Planned for an engine on the CPU: every component is host memory (`laden.memory.estimate.on_the_cpu`)."""

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


class MemoryEstimator(Protocol):
    """One phase of one engine: its predicted components on one rank."""

    def estimate(self, cfg: Any, shapes: ModelShapes) -> PhaseEstimate: ...


def nbytes(dtype_name: str) -> int:
    from laden.model.dtypes import torch_dtype

    return torch_dtype(dtype_name).itemsize


def master_dtype(cfg: Any) -> torch.dtype:
    """The master weights' dtype: bf16 for `adam_bf16`, else `actor.optimizer_dtype`."""
    from laden.model.dtypes import torch_dtype
    from laden.optim import OptimSettings

    return OptimSettings.from_config(cfg.actor.optimizer, 1).master_dtype(
        torch_dtype(cfg.actor.optimizer_dtype)
    )


def state_keys(cfg: Any) -> int:
    """Per-parameter optimizer state tensors at the master dtype (Adam's two moments, ...)."""
    from laden.engine.roundpipe.host.memory import optimizer_state_keys

    opt = cfg.actor.optimizer
    return len(optimizer_state_keys(opt.type, getattr(opt, "momentum", 0.0)))


PAIR_JOBS = ("dpo", "rw")
"""Jobs (`train_dataset.type`) whose micro-batches hold whole pairs: a chosen and a rejected sequence."""


def longest_sequence(cfg: Any) -> int:
    """The longest sequence a micro-batch must hold: for RL the prompt budget plus `max_new_tokens`; for
    the other jobs the longer `max_length` of `train_dataset` and `valid_dataset` (their evaluation packs
    under the same budget)."""
    from laden.config.validate_actor import longest_max_length

    if cfg.train_dataset.type == "rl":
        return cfg.train_dataset.max_length + cfg.gconfig.max_new_tokens
    return longest_max_length(cfg)


def sequences_per_sample(cfg: Any) -> int:
    """Sequences a sample trains as: a pair's two (`laden dpo`, `laden rw`), else one."""
    return 2 if cfg.train_dataset.type in PAIR_JOBS else 1


def tokens_per_microbatch(cfg: Any) -> int:
    """The largest micro-batch the trainer packs: the token budget, else one longest sample (a pair: two
    longest sequences)."""
    return int(cfg.actor.mb_spec.max_tokens_per_mb or sequences_per_sample(cfg) * longest_sequence(cfg))


def loss_chunk_tokens(cfg: Any, tokens: int) -> int:
    """Tokens whose logits the loss holds at once: `actor.loss_chunk_size`, or every token of the
    micro-batch for `laden sft` with `actor.chunked_loss: false` (the only job that reads it: the
    others' losses are always chunked, and the reward model's one-row head has no vocabulary)."""
    whole = cfg.train_dataset.type == "sft" and not cfg.actor.chunked_loss
    return max(tokens, 1) if whole else cfg.actor.loss_chunk_size


def checkpoint_pages(cfg: Any) -> list[Component]:
    """The checkpoint's safetensors files as read (memory-mapped, so their pages count in the resident
    set while the model loads); nothing for a random init (`actor.init_from_config`)."""
    from pathlib import Path

    path = Path(cfg.actor.path)
    if cfg.actor.init_from_config or not path.is_dir():
        return []
    nbytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return (
        [Component("host: the checkpoint's pages, memory-mapped while it loads", host=nbytes, load_time=True)]
        if nbytes
        else []
    )


def layer_activations(model: Any, cfg: Any, tokens: int) -> list[tuple[int, int]]:
    """Per pipeline step of `model` (embedding, decoder layers, head and loss): the (kept, transient)
    activation bytes of a `tokens` micro-batch, from `laden.model.split.activation_bytes` (checked
    against saved-tensor hooks there), at the compute dtype, with the loss's logits one chunk of
    `loss_chunk_tokens` tokens."""
    from laden.model.dtypes import torch_dtype
    from laden.model.split import activation_bytes, split_causal_lm

    chunk = loss_chunk_tokens(cfg, tokens)
    dtype = torch_dtype(cfg.actor.dtype)
    return [
        activation_bytes(step, tokens, dtype=dtype, loss_chunk_size=chunk)
        for step in split_causal_lm(model).layers
    ]
