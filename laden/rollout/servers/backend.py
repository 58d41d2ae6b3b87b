"""The vLLM and SGLang servers' backend object (`rollout.backend: vllm:dNtM`, `sglang:dNtM`): servers of
their own, on GPUs the trainer does not use, started from one trainer process on `actor.path` and
handed each new policy as a versioned directory."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from laden.config import LadenConfig
from laden.rollout.backend import RolloutBackend

if TYPE_CHECKING:
    from laden.rollout.base import RolloutEngine


class ServerBackend(RolloutBackend):
    name = "servers"

    def refusals(self, cfg: LadenConfig, *, world_size: int) -> list[str]:
        problems = []
        if world_size > 1:
            problems.append(
                f"rollout.backend={cfg.rollout.backend!r} under {world_size} processes: laden rl starts the servers "
                "from one trainer process; run it in one process (a d>1 rollout allocation still serves every "
                "trainer request), or use rollout.backend: native:dN with one engine per process"
            )
        if cfg.actor.weight_update_mode not in self.update_modes:
            problems.append(
                f"rollout.backend={cfg.rollout.backend!r} with actor.weight_update_mode="
                f"{cfg.actor.weight_update_mode!r}: laden rl hands servers their new weights as versioned "
                "directories; set actor.weight_update_mode: disk"
            )
        return problems

    def build(
        self, cfg: LadenConfig, *, model: Any = None, tokenizer: Any = None, model_dir: str | Path | None = None,
        device: Any = None, **kwargs: Any,
    ) -> RolloutEngine:  # fmt: skip
        """Servers started on `model_dir` / `actor.path` (`model` and `device` are the native engine's)."""
        from laden.rollout.factory import max_concurrent_rollouts, tokenizer_or_none
        from laden.rollout.servers import start_server_engine

        path = Path(model_dir or cfg.actor.path) if (model_dir or cfg.actor.path) else None
        if path is None:
            raise ValueError(
                f"rollout.backend={cfg.rollout.backend!r} needs a model directory: set actor.path"
            )
        kwargs.setdefault("max_concurrent_requests", max_concurrent_rollouts(cfg))
        if tokenizer is None:
            tokenizer = tokenizer_or_none(path, without="stop strings split by a pause will not be found")
        kwargs.setdefault("tokenizer", tokenizer)
        return start_server_engine(self.mode, model_dir=path, cfg=cfg, **kwargs)
