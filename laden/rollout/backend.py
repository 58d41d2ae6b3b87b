"""A rollout engine's backend object: what laden asks about a generation engine besides generating.

`RolloutEngine` (`laden.rollout.base`) generates; everything else about a rollout engine is asked of
its backend object, found once from `rollout.backend` by `resolve_rollout(cfg)`: whether it runs in
the trainer's process (`in_process`: the native engine) or as servers of its own, which weight update
modes it takes and whether it takes partial ones, where it runs beside the trainer (`placement`),
whether it can sleep on the trainer's GPU while it trains, what `laden rl` refuses of it, whether what
it needs outside the process answers (`check_ready`), and the engine itself (`build`). A new rollout engine is a folder with a `backend.py` and one
`register_rollout_backend` line. `resolve_rollout` and the config validator are the only readers of
the `rollout.backend` string.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from laden.config import AllocationMode, LadenConfig
from laden.config.alloc import check_alloc
from laden.engine.backend import register_backend

if TYPE_CHECKING:
    from laden.engine.backend import TrainBackend
    from laden.rollout.base import RolloutEngine

__all__ = ["RolloutBackend", "register_rollout_backend", "resolve_rollout"]


class RolloutBackend:
    """One rollout engine's answers for the allocation `mode` of `rollout.backend` (subclassed per engine)."""

    name: ClassVar[str]
    in_process: ClassVar[bool] = False
    """Whether the engine runs in the trainer's process (it can then share the trainer's GPU, take
    weights in place and sleep while the trainer trains) rather than as servers of its own."""
    update_modes: ClassVar[tuple[str, ...]] = ("disk",)
    """The `actor.weight_update_mode`s `laden rl` can hand it new weights with."""
    accepts_partial_updates: ClassVar[bool] = False
    """Whether it takes a `PartialUpdate` (only the tensors that changed, e.g. LoRA's merged projections)."""

    def __init__(self, mode: AllocationMode) -> None:
        self.mode = mode
        """The parsed `rollout.backend`."""

    def placement(
        self, cfg: LadenConfig, device: torch.device, *, world_size: int, train: TrainBackend,
        device_count: int | None = None,
    ) -> torch.device:  # fmt: skip
        """Where the engine runs, for a trainer on `device` (servers: on GPUs of their own, so the
        trainer's device stands for "not this process's")."""
        return device

    def refusals(self, cfg: LadenConfig, *, world_size: int) -> list[str]:
        """What `laden rl` cannot run with this engine under `world_size` processes, each with its fix."""
        return []

    def check_ready(self, cfg: LadenConfig) -> None:
        """Raise, naming what and where, when something the engine needs outside this process is not
        there (servers started elsewhere that do not answer); called once at start-up, before the model
        is loaded."""

    def build(self, cfg: LadenConfig, **kwargs: Any) -> RolloutEngine:
        """The running engine (`laden.rollout.factory.build_rollout_engine` documents `kwargs`)."""
        raise NotImplementedError


_REGISTRY: dict[str, Callable[[], type[RolloutBackend]]] = {}


def register_rollout_backend(
    name: str, backend: str | Callable[[], type[RolloutBackend]], *, dims: str
) -> None:
    """Make `rollout.backend: <name>:<dims>` run `backend` (a `"module:Class"` path imported when first
    asked for, or a callable returning the class); `dims`: the dimension letters it supports."""
    register_backend(_REGISTRY, "rollout", name, backend, dims=dims)


def resolve_rollout(cfg: LadenConfig) -> RolloutBackend:
    """The backend object of `rollout.backend`, its allocation checked."""
    errors = check_alloc(cfg.rollout.backend, role="rollout", field="rollout.backend")
    if errors:
        raise ValueError("; ".join(errors))
    mode = AllocationMode.parse(cfg.rollout.backend)
    return _REGISTRY[mode.backend]()(mode)


register_rollout_backend("native", "laden.rollout.native.backend:NativeBackend", dims="dt")
register_rollout_backend("vllm", "laden.rollout.servers.backend:ServerBackend", dims="dtp")
register_rollout_backend("sglang", "laden.rollout.servers.backend:ServerBackend", dims="dtp")
