"""Validation of where a run places its work: the actor's, rollout's and critic's parallel layouts.

Each `backend` string (`fsdp:d4t2`, `sglang:d2`) must parse, fit the cluster's GPUs (server
rollouts need GPUs of their own next to the actor's, the native engine shares the actor's), and
the critic must train in the actor's processes with the actor's split of each batch. Settings of
an engine the run does not use give a `UserWarning`. Error lines follow `laden.config.validate`'s
form: `<dotted.field>=<value> <why>; <fix>`.
"""

from __future__ import annotations

import dataclasses
import warnings

from laden.config.alloc import BACKEND_DIMS, DIM_LETTERS, AllocationMode, check_alloc
from laden.config.schema import LadenConfig

__all__ = [
    "SERVER_ROLLOUT_BACKENDS",
    "alloc_errors",
    "critic_errors",
    "parse_or_none",
    "warn_ignored_sections",
]

SERVER_ROLLOUT_BACKENDS = ("sglang", "vllm")
"""Rollout backends that run as separate servers on GPUs of their own."""


def parse_or_none(text: str) -> AllocationMode | None:
    try:
        return AllocationMode.parse(text)
    except ValueError:
        return None


def alloc_errors(cfg: LadenConfig, *, rl: bool) -> list[str]:
    errors = check_alloc(cfg.actor.backend, role="actor", field="actor.backend")
    if rl:
        errors += check_alloc(cfg.rollout.backend, role="rollout", field="rollout.backend")
    if cfg.actor.optimizer.type == "adam_bf16" and cfg.actor.backend.startswith("megatron:"):
        errors.append(
            "actor.optimizer.type='adam_bf16' is not supported by the megatron backend; use adam or sgd"
        )
    if errors or cfg.cluster.n_nodes < 1 or cfg.cluster.n_gpus_per_node < 1:
        return errors  # n_gpus_per_node 0: processes on the CPU, as many as the launch starts
    return _gpu_total_errors(cfg, rl=rl)


def _gpu_total_errors(cfg: LadenConfig, *, rl: bool) -> list[str]:
    nodes, per_node = cfg.cluster.n_nodes, cfg.cluster.n_gpus_per_node
    total = nodes * per_node
    have = f"cluster.n_nodes * cluster.n_gpus_per_node = {nodes} * {per_node} = {total}"
    actor = AllocationMode.parse(cfg.actor.backend)
    errors = []
    if actor.num_gpus > total:
        errors.append(
            f"actor.backend={cfg.actor.backend!r} needs {actor.num_gpus} GPUs but {have}; "
            "lower its parallel sizes or raise cluster.n_gpus_per_node / cluster.n_nodes"
        )
    if not rl:
        return errors
    rollout = AllocationMode.parse(cfg.rollout.backend)
    from laden.config.validate_servers import attached_server_urls

    if rollout.backend in SERVER_ROLLOUT_BACKENDS and attached_server_urls(cfg)[0]:
        return errors  # servers started elsewhere take none of this cluster's GPUs
    if rollout.backend in SERVER_ROLLOUT_BACKENDS:
        need = actor.num_gpus + rollout.num_gpus
        if need > total and actor.num_gpus <= total:
            errors.append(
                f"rollout.backend={cfg.rollout.backend!r} needs {rollout.num_gpus} GPUs of its own "
                f"next to actor.backend={cfg.actor.backend!r} ({actor.num_gpus}): {need} GPUs but "
                f"{have}; lower the parallel sizes, add GPUs, or use rollout.backend: native:d... "
                "(it shares the training GPUs)"
            )
    elif rollout.num_gpus > total:
        errors.append(
            f"rollout.backend={cfg.rollout.backend!r} needs {rollout.num_gpus} GPUs but {have}; "
            "lower its parallel sizes or add GPUs"
        )
    return errors


def critic_errors(cfg: LadenConfig, *, rl: bool) -> list[str]:
    """The critic trains in the actor's processes, on the same data split: the same processes, d, t and c."""
    c = cfg.critic
    if c is None:
        return []
    errors = check_alloc(c.backend, role="actor", field="critic.backend") if c.backend else []
    critic, actor = parse_or_none(c.backend or cfg.actor.backend), parse_or_none(cfg.actor.backend)
    if errors or critic is None or actor is None:
        return errors  # actor.backend's own errors are reported by `alloc_errors`
    shown = f"critic.backend={c.backend!r}" if c.backend else f"critic.backend='' ({cfg.actor.backend!r})"
    if _data_layout(critic) != _data_layout(actor):
        errors.append(
            f"{shown} must train in the actor's processes on the actor's share of each batch: "
            f"{actor.num_gpus} process{'es' if actor.num_gpus > 1 else ''} with d={actor.dp}, t={actor.tp} and c={actor.cp} as actor.backend="
            f"{cfg.actor.backend!r} has; {_critic_fix(critic, actor)}"
        )
    budget = None if c.mb_spec is None else c.mb_spec.max_tokens_per_mb
    need = cfg.train_dataset.max_length + cfg.gconfig.max_new_tokens
    if rl and budget is not None and budget < need:
        errors.append(
            f"critic.mb_spec.max_tokens_per_mb={budget} is smaller than train_dataset.max_length + "
            f"gconfig.max_new_tokens = {need}; set it to at least {need}"
        )
    return errors


def _data_layout(mode: AllocationMode) -> tuple[int, int, int, int]:
    """What fixes which share of a batch each process trains on: processes, d, t and c (pipeline outermost)."""
    return mode.num_gpus, mode.dp, mode.tp, mode.cp


def _critic_fix(critic: AllocationMode, actor: AllocationMode) -> str:
    """The critic.backend with the actor's sizes on the critic's engine, when that engine has those dimensions."""
    used = [letter for letter in DIM_LETTERS if actor.size(letter) != 1 and letter != "e"]
    dims = "".join(f"{letter}{actor.size(letter)}" for letter in used) or "d1"
    dims = dims if dims.startswith("d") else f"d{actor.dp}{dims}"
    missing = [letter for letter in used if letter not in BACKEND_DIMS["actor"][critic.backend]]
    if not missing:
        return f"set critic.backend: {critic.backend}:{dims}, or leave it ''"
    return f"the {critic.backend} engine has no {'/'.join(missing)} dimension: leave critic.backend '' (the actor's)"


def warn_ignored_sections(cfg: LadenConfig) -> None:
    backend = cfg.actor.backend.partition(":")[0]
    backend = "archon" if backend == "megatron" else backend  # megatron: modes run on the archon engine
    for section in ("fsdp", "roundpipe", "archon"):
        value = getattr(cfg.actor, section)
        if backend != section and value != type(value)():
            changed = [
                f.name
                for f in dataclasses.fields(value)
                if getattr(value, f.name) != getattr(type(value)(), f.name)
            ]
            warnings.warn(
                f"actor.{section}.{{{', '.join(changed)}}} are ignored because actor.backend="
                f"{cfg.actor.backend!r} is not a {section} backend; remove them or switch backend",
                UserWarning,
                stacklevel=3,
            )
