"""The vLLM and SGLang servers' backend object (`rollout.backend: vllm:dNtM`, `sglang:dNtM`): servers of
their own, handed each new policy as a versioned directory (`actor.weight_update_mode: disk`) or, SGLang's,
by a broadcast from the trainer (`xccl`, `laden.rollout.servers.broadcast`).

laden starts them on `actor.path`, from rank 0, on GPUs of rank 0's node after those of its trainer
processes (`CUDA_VISIBLE_DEVICES` slices), listening on `rollout.server_host`; or, with
`rollout.server_urls` (or AReaL's `$AREAL_LLM_SERVER_ADDRS`), it attaches to servers started elsewhere,
which load each version from the run directory: a filesystem they must share with the trainer, at the
same path (disk), or join the trainer's broadcast group, which they must reach (xccl). Under torchrun rank 0 alone drives the servers (`laden.rl.data_ranks`)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from laden.config import LadenConfig
from laden.config.validate_servers import attached_server_urls, normalize_server_url
from laden.rollout.backend import RolloutBackend

if TYPE_CHECKING:
    from laden.rollout.base import RolloutEngine

log = logging.getLogger(__name__)


class ServerBackend(RolloutBackend):
    name = "servers"
    update_modes = ("disk", "xccl")

    def refusals(self, cfg: LadenConfig, *, world_size: int) -> list[str]:
        problems = []
        mode = cfg.actor.weight_update_mode
        if mode not in self.update_modes:
            problems.append(
                f"rollout.backend={cfg.rollout.backend!r} with actor.weight_update_mode={mode!r}: laden rl hands "
                "servers their new weights as versioned directories (disk) or by broadcast (xccl, SGLang); set "
                "actor.weight_update_mode: disk"
            )
        elif mode == "xccl" and self.mode.backend == "vllm":
            problems.append(
                f"rollout.backend={cfg.rollout.backend!r} with actor.weight_update_mode='xccl': vLLM 0.32's servers "
                "receive broadcast weights only through their own NCCL weight-transfer engine (vLLM's stateless "
                "group and PyNccl communicator, GPUs only), which laden's trainer does not join; set "
                "actor.weight_update_mode: disk (versioned directories), or use sglang servers for broadcasts"
            )
        return problems

    def check_ready(self, cfg: LadenConfig) -> None:
        """Servers started elsewhere answer their health check within `rollout.setup_timeout` (`ServerStartError`
        naming the first that does not); nothing to check for servers laden starts."""
        from laden.rollout.servers.launch import attach_servers

        urls = self.attached_urls(cfg)
        if urls:
            attach_servers(urls, health_path="/health", wait_s=cfg.rollout.setup_timeout)
            if cfg.actor.weight_update_mode == "xccl":
                log.info(
                    "rollout servers %s answer; they receive each weight version by broadcast from this "
                    "host, whose address they must reach", ", ".join(urls),
                )  # fmt: skip
            else:
                log.info(
                    "rollout servers %s answer; they load each weight version from %s, which must be on a "
                    "filesystem they share at that path", ", ".join(urls), cfg.cluster.fileroot,
                )  # fmt: skip

    def attached_urls(self, cfg: LadenConfig) -> list[str]:
        """The base URLs of the servers started elsewhere (`rollout.server_urls`, else
        `$AREAL_LLM_SERVER_ADDRS`); [] when laden starts them."""
        return [normalize_server_url(u) for u in attached_server_urls(cfg)[0]]

    def build(
        self, cfg: LadenConfig, *, model: Any = None, tokenizer: Any = None, model_dir: str | Path | None = None,
        device: Any = None, **kwargs: Any,
    ) -> RolloutEngine:  # fmt: skip
        """Servers started on `model_dir` / `actor.path`, or attached to (`model` and `device` are the
        native engine's)."""
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
        urls = self.attached_urls(cfg)
        if urls:
            kwargs.setdefault("urls", urls)
        else:
            kwargs.setdefault("first_device", trainer_gpus_on_this_node())
        return start_server_engine(self.mode, model_dir=path, cfg=cfg, **kwargs)


def trainer_gpus_on_this_node() -> int:
    """The GPUs this node's trainer processes use (the first `LOCAL_WORLD_SIZE` visible ones, torchrun's
    `--nproc-per-node`; one in a plain process), which the servers laden starts leave to them; 0 without
    CUDA."""
    import torch

    if not torch.cuda.is_available():
        return 0
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
