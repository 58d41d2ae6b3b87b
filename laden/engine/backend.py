"""A training engine's backend object: what laden asks about an engine besides its step.

`TrainEngine` (`laden.engine.base`) is the step; everything else about an engine is asked of its
backend object, found once from `actor.backend` by `resolve_backend(cfg)`:

- how its model is loaded (`load_model`) and where the trainer packs its batches (`batches_on_host`);
- the fewest micro-batches a step packs (`min_micro_batches`), whether it recomputes by design;
- its memory model for the planner and the `auto` knobs (`training_estimator`, None when it has none;
  `frozen_estimator` for a never-stepped model on it)
  and the knob changes that fix its out-of-memory errors (`oom_fixes`, `host_oom_fixes`);
- the engine itself (`build`).

A new engine is a folder with a `backend.py` whose class subclasses `TrainBackend`, and one line in
`register_train_backend` (the three engines' lines are at the bottom of this module; a test
registers a toy one). `resolve_backend` and the config validator are the only readers of the
`actor.backend` string.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from laden.config import AllocationMode, LadenConfig
from laden.config.alloc import BACKEND_DIMS, IMPLEMENTED_BACKENDS, Role

if TYPE_CHECKING:
    from laden.engine.base import TrainEngine
    from laden.engine.estimates import MemoryEstimator
    from laden.engine.runtime import Runtime

__all__ = ["TrainBackend", "register_backend", "register_train_backend", "resolve_backend"]

log = logging.getLogger("laden.runtime")


class TrainBackend:
    """One training engine's answers, for the allocation `mode` of `actor.backend` (subclassed per engine)."""

    name: ClassVar[str]
    """The engine (`fsdp`, `roundpipe`, `archon`): what `laden.config.usage` and the logs call it."""
    batches_on_host: ClassVar[bool] = False
    """Whether the trainer packs micro-batches on the host (the engine uploads each with its stages)
    rather than on this rank's device."""
    keeps_policy_on_host: ClassVar[bool] = False
    """Whether the trained weights live in host memory between steps (a colocated rollout engine then
    needs a copy of its own on the GPU)."""
    recomputes_by_design: ClassVar[bool] = False
    """Whether the engine recomputes activations whatever `actor.gradient_checkpointing` says."""

    def __init__(self, mode: AllocationMode) -> None:
        self.mode = mode
        """The parsed `actor.backend`."""

    @property
    def num_processes(self) -> int:
        """Processes the allocation runs on (one per data, tensor, context and pipeline rank)."""
        return self.mode.num_gpus

    def min_micro_batches(self, cfg: LadenConfig) -> int:
        """Micro-batches a step packs at least (`actor.mb_spec.n_mbs`)."""
        return cfg.actor.mb_spec.n_mbs

    def load_model(self, cfg: LadenConfig, rt: Runtime) -> nn.Module:
        """This rank's model as read from `actor.path` (the patches and adapters come after)."""
        from laden.model.hf.loading import load_causal_lm

        return load_causal_lm(cfg.actor.path, **model_load_kwargs(cfg))

    def build(
        self, cfg: LadenConfig, model: nn.Module, *, total_steps: int, device: torch.device
    ) -> TrainEngine:
        """The engine over `model`, with `actor.*` knobs mapped onto it."""
        raise NotImplementedError

    def training_estimator(
        self, model: Any = None, gpu_capacity: int | None = None
    ) -> MemoryEstimator | None:
        """The training step's memory model (`model`: the meta-device build, if made), or None when
        the planner has none for this engine: `laden plan` refuses it and the `auto` knobs fall back
        to their memory-saving values."""
        return None

    def frozen_estimator(self, model: Any = None) -> MemoryEstimator | None:
        """The memory model of a never-stepped model on this engine (`laden.rl.scoring.frozen_engine`: the
        reference model, the teacher): what it holds between its forwards, given the never-stepped config
        (`never_stepped`); None when the planner has none for this engine."""
        return None

    def host_oom_fixes(self, cfg: LadenConfig) -> list[str]:
        """Knob changes for a host-memory OOM in training, with this run's values, most effective first."""
        actor, fixes = cfg.actor, []
        if actor.fsdp.offload_params:
            fixes.append(
                "actor.fsdp.offload_params=false (parameters, gradients and optimizer states back on the GPU)"
            )
        if actor.optimizer.type == "adam":
            fixes.append(
                "actor.optimizer.type=adam_bf16 with actor.optimizer_dtype=bfloat16 (bf16 master weights and states)"
            )
        if actor.fsdp.memory_efficient_load:
            fixes.append(
                "actor.fsdp.memory_efficient_load=false (rank 0 no longer holds the whole model at load)"
            )
        return fixes

    def oom_fixes(self, cfg: LadenConfig, *, tokens_per_mb: int, longest_seq: int) -> list[str]:
        """Knob changes for a training-phase GPU OOM, cheapest first, with values and their cost in speed."""
        actor = cfg.actor
        fixes = []
        smaller = max(longest_seq, tokens_per_mb // 2)
        if smaller < tokens_per_mb:
            fixes.append(
                f"actor.mb_spec.max_tokens_per_mb={smaller} (now {tokens_per_mb}; the longest sequence of this "
                f"step has {longest_seq} tokens; costs little while micro-batches stay long: halving 32K to 16K "
                "tokens cost 2.4% on a Qwen3-1.7B shape), or oom_policy=auto to re-split failing steps automatically"
            )
        if not actor.gradient_checkpointing:
            fixes.append(
                "actor.gradient_checkpointing=true (recompute activations in backward; costs about a third more "
                "compute)"
            )
        if not actor.chunked_loss:
            fixes.append("actor.chunked_loss=true (never materialise the [tokens, vocab] logits; no slower)")
        if actor.optimizer.type == "adam":
            fixes.append(
                "actor.optimizer.type=adam_bf16 with actor.optimizer_dtype=bfloat16 (8 instead of 16 bytes per "
                "parameter; as fast, bf16 masters with Kahan compensation)"
            )
        return fixes

    def training_oom_fixes(
        self, cfg: LadenConfig, *, host: bool, tokens_per_mb: int, longest_seq: int
    ) -> list[str]:
        """The fixes of a training step's OOM: the host's first when the host ran out, then the GPU's."""
        fixes = self.host_oom_fixes(cfg) if host else []
        return fixes + self.oom_fixes(cfg, tokens_per_mb=tokens_per_mb, longest_seq=longest_seq)


def model_load_kwargs(cfg: LadenConfig) -> dict[str, Any]:
    """How every engine reads `actor.path`: the master dtype, random init, seed and attention."""
    from laden.model.dtypes import torch_dtype

    actor = cfg.actor
    return dict(dtype=torch_dtype(actor.optimizer_dtype), init_from_config=actor.init_from_config, seed=cfg.seed,
                attn_impl=actor.attn_impl)  # fmt: skip


_REGISTRY: dict[str, Callable[[], type[TrainBackend]]] = {}


def register_backend(
    registry: dict[str, Callable[[], type[Any]]], role: Role, name: str, backend: str | Callable[[], type[Any]],
    *, dims: str,
) -> None:  # fmt: skip
    """Put `backend` in `registry` under `name` (a `"module:Class"` path imported when first asked for, or a
    callable returning the class), and make the config tables of `role` accept `<name>:<dims>`."""
    if isinstance(backend, str):
        module, _, attr = backend.partition(":")
        loader: Callable[[], type[Any]] = lambda: getattr(importlib.import_module(module), attr)  # noqa: E731
    else:
        loader = backend
    registry[name] = loader
    BACKEND_DIMS[role][name] = dims
    if name not in IMPLEMENTED_BACKENDS[role]:
        IMPLEMENTED_BACKENDS[role] = (*IMPLEMENTED_BACKENDS[role], name)


def register_train_backend(name: str, backend: str | Callable[[], type[TrainBackend]], *, dims: str) -> None:
    """Make `actor.backend: <name>:<dims>` run `backend` (a `"module:Class"` path imported when first
    asked for, or a callable returning the class); `dims`: the dimension letters it supports."""
    register_backend(_REGISTRY, "actor", name, backend, dims=dims)


def resolve_backend(cfg: LadenConfig) -> TrainBackend:
    """The backend object of `actor.backend` (checked by the config validator before it gets here)."""
    mode = AllocationMode.parse(cfg.actor.backend)
    loader = _REGISTRY.get(mode.backend)
    if loader is None:
        raise ValueError(
            f"actor.backend={cfg.actor.backend!r}: backend {mode.backend!r} has no engine; use "
            + ", ".join(_REGISTRY)
        )
    return loader()(mode)


register_train_backend("fsdp", "laden.engine.fsdp.backend:FsdpBackend", dims="dtc")
register_train_backend("roundpipe", "laden.engine.roundpipe.backend:RoundPipeBackend", dims="d")
register_train_backend("archon", "laden.engine.archon.backend:ArchonBackend", dims="dtcpe")
register_train_backend(
    "megatron", "laden.engine.archon.backend:ArchonBackend", dims="dtcpe"
)  # runs on archon
