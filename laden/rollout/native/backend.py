"""The native engine's backend object (`rollout.backend: native:dN[tM]`): generation in the trainer's
process, one engine per process (`native:dNtM`: N engines of M tensor-parallel ranks under torchrun)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from laden.config import LadenConfig
from laden.rollout.backend import RolloutBackend

if TYPE_CHECKING:
    from laden.engine.backend import TrainBackend
    from laden.rollout.base import RolloutEngine


class NativeBackend(RolloutBackend):
    name = "native"
    in_process = True
    update_modes = ("disk", "xccl", "in_place")
    accepts_partial_updates = True

    def placement(
        self, cfg: LadenConfig, device: torch.device, *, world_size: int, train: TrainBackend,
        device_count: int | None = None,
    ) -> torch.device:  # fmt: skip
        """One process with an fsdp trainer and a second GPU declared (`cluster.n_gpus_per_node: 2`): the
        next GPU after the trainer's, generation and training on separate GPUs (AReaL's
        `sglang:d1+fsdp:d1`). Otherwise the trainer's device, colocated (it sleeps while the trainer
        trains): under torchrun every rank keeps its engine on its own GPU, and the roundpipe engine
        pools every visible GPU of its process."""
        declared = cfg.cluster.n_nodes * cfg.cluster.n_gpus_per_node
        if world_size > 1 or device.type != "cuda" or train.name != "fsdp" or declared < 2:
            return device
        count = torch.cuda.device_count() if device_count is None else device_count
        index = (device.index or 0) + 1
        if index >= count:
            raise ValueError(
                f"cluster.n_gpus_per_node={cfg.cluster.n_gpus_per_node} puts rollout.backend={cfg.rollout.backend!r} "
                f"on a GPU of its own (cuda:{index}), but this process sees {count} GPU(s); make a second GPU "
                "visible (CUDA_VISIBLE_DEVICES), or set cluster.n_gpus_per_node=1 to generate on the training GPU"
            )
        return torch.device("cuda", index)

    def refusals(self, cfg: LadenConfig, *, world_size: int) -> list[str]:
        if self.mode.tp == 1:
            return []
        return [
            f"rollout.backend={cfg.rollout.backend!r}: laden rl runs a tensor-parallel native engine only "
            "when every rank sends it the same requests, and its trainer ranks each generate their own share "
            "of the batch; use t=1 (native:dN, one engine per process) for laden rl. The tensor-parallel "
            "engine itself works (laden.rollout.build_rollout_engine under torchrun)"
        ]

    def build(
        self, cfg: LadenConfig, *, model: Any = None, tokenizer: Any = None, model_dir: str | Path | None = None,
        device: Any = None, **kwargs: Any,
    ) -> RolloutEngine:  # fmt: skip
        """`model` (a causal LM, moved to `device` in the actor's dtype) or loaded from `model_dir` /
        `actor.path`; each of the N engines samples with `seed` plus its index (`rank // M`)."""
        from laden.model.dtypes import torch_dtype
        from laden.rollout.factory import max_concurrent_rollouts, tokenizer_or_none
        from laden.rollout.native import NativeEngine

        mode, world = self.mode, int(os.environ.get("WORLD_SIZE", "1"))
        if mode.dp * mode.tp != world:
            n = mode.dp * mode.tp
            per = (
                "one copy per process"
                if mode.tp == 1
                else f"each copy on {mode.tp} processes (tensor parallel)"
            )
            raise ValueError(
                f"rollout.backend={cfg.rollout.backend!r}: the native engine runs {per}, and this run has {world} "
                f"process(es); launch {n} (torchrun --nproc-per-node {n}) or set rollout.backend: native:d{world}"
            )
        path = Path(model_dir or cfg.actor.path) if (model_dir or cfg.actor.path) else None
        dtype = torch_dtype(cfg.actor.dtype)
        tp = None
        if mode.tp > 1:
            from laden.engine.parallel.launch import init_distributed
            from laden.rollout.native.tensor_parallel import tensor_parallel_groups

            _, _, _, local = init_distributed()
            device = device or local
            tp = tensor_parallel_groups(mode.tp)
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if model is None:
            if path is None:
                raise ValueError("the native engine needs a model: set actor.path (or pass model=)")
            from laden.model.hf.loading import load_causal_lm

            model = load_causal_lm(
                str(path), dtype=dtype, init_from_config=cfg.actor.init_from_config, seed=cfg.seed
            )
        if tokenizer is None and path is not None:
            tokenizer = tokenizer_or_none(path, without="requests with stop strings are refused")
        if tp is not None:  # on the host: the device never holds the whole model
            from laden.rollout.native.tensor_parallel import ShardLayout

            ShardLayout(model.config, rank=tp.rank, size=tp.size).shard_model(model)
        model = model.to(device=dev, dtype=dtype)
        kwargs.setdefault("max_model_len", cfg.train_dataset.max_length + cfg.gconfig.max_new_tokens)
        engine_index = int(os.environ.get("RANK", "0")) // mode.tp  # its M ranks share one sampler
        return NativeEngine(
            model, tokenizer, max_concurrent=max_concurrent_rollouts(cfg),
            mem_fraction_static=cfg.native.mem_fraction_static, seed=cfg.seed + engine_index, tensor_parallel=tp,
            **kwargs,
        )  # fmt: skip
