"""`laden rl`'s rollout engine beside the trainer: building it with the trainer's weights, whether it
sleeps (frees its KV cache, and its weights beside a trainer that keeps the policy on the host) while
the trainer trains, and handing it each new policy as `actor.weight_update_mode` says (in place, by
buckets, or through disk, with the disk as the retry of an update that ran out of memory)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import torch

from laden.config import LadenConfig
from laden.engine.oom import is_host_oom, is_oom, release_cached_memory
from laden.model.dtypes import torch_dtype
from laden.rl.run_part import RunPart

log = logging.getLogger("laden.rl")


def phase_oom_fixes(cfg: LadenConfig, phase: str, cause: BaseException) -> list[str]:
    """The knob changes for `laden rl`'s `phase` running out of memory (`laden.memory.doctor`)."""
    from laden.memory.doctor import phase_fixes

    return phase_fixes(cfg, phase, host=is_host_oom(cause))


class ServedByRankZero:
    """The rollout engine of a trainer process that generates nothing: rank 0 drives the rollout servers for
    every process (`laden.rl.data_ranks`). It follows the weight version it is told, so the ranks agree on
    it, and holds nothing else."""

    def __init__(self, version: int) -> None:
        self._version = version

    @property
    def version(self) -> int:
        """The version of the weights the servers generate with now."""
        return self._version

    async def generate(self, requests: Any) -> Any:
        """Never called: this process has no share of the prompts (`_generation_share` is None)."""
        raise RuntimeError(
            f"{len(requests)} generation request(s) on a trainer rank other than 0; rank 0 drives the "
            "rollout servers for every process"
        )
        yield  # an async generator, as `RolloutEngine.generate` is

    async def update_weights(self, source: Any, version: int) -> None:
        """Rank 0 loads the servers; this process takes the new version."""
        self._version = version

    async def pause(self) -> None:
        """Nothing of this process's is generating."""

    async def resume(self) -> None:
        """Nothing of this process's is paused."""

    async def sleep(self, *, weights: bool = False) -> None:
        """Servers never sleep during training."""

    async def wake(self) -> None:
        """Servers never sleep during training."""

    async def close(self) -> None:
        """Rank 0 ends the servers it started."""

    def sleep_frees_bytes(self) -> int | None:
        """None: the servers' memory is not this process's."""
        return None

    def sampling_state(self) -> dict[str, Any] | None:
        """None: servers sample with their own seeds."""
        return None

    def load_sampling_state(self, state: dict[str, Any]) -> None:
        """Nothing to restore."""


class WeightSync(RunPart):
    """The rollout engine and the weight updates of a `laden rl` run (a part of `laden.rl.trainer._Run`)."""

    _server_channel: Any = None
    """Rank 0's end of the broadcast group with the rollout servers (`xccl`), made at the first update."""

    def _rollout_engine(self, *, version: int):
        """The rollout engine, holding its own copy of the policy in the compute dtype."""
        from laden.rollout.factory import build_rollout_engine, native_engine_from_weights

        cfg = self.cfg
        t0 = time.perf_counter()
        if self._serves() and self._generation_share() is None:
            return ServedByRankZero(version)
        if self._serves():  # vLLM / SGLang servers, started on actor.path (given the first weights by main)
            engine = build_rollout_engine(cfg, tokenizer=self.tokenizer, initial_version=version)
            log.info("rollout servers %s ready in %.1f s", cfg.rollout.backend, time.perf_counter() - t0)
            return engine
        device = self.rollout_device
        if device != self.rt.device:
            log.info("rollout engine %s on %s, the trainer on %s: generation and training run on separate GPUs",
                     cfg.rollout.backend, device, self.rt.device)  # fmt: skip
        # the trainer's weights (a resumed run's, or its own initialisation) before the first rollout
        engine = native_engine_from_weights(
            cfg, self.engine.named_weights(), device=device, tokenizer=self.tokenizer, version=version
        )
        log.info("rollout engine %s ready in %.1f s", cfg.rollout.backend, time.perf_counter() - t0)
        if self._rollout_rng is not None:  # resumed: sampling continues as it was
            engine.load_sampling_state(self._rollout_rng)
        return engine

    def _drop_newer_weight_versions(self, start: int) -> None:
        """Weight versions a killed run published after its last checkpoint are written again (by
        `actor.weight_update_mode: disk`, or by the disk fallback of an in-place update)."""
        import shutil

        from laden.weights import WeightUpdateMeta, list_versions, version_dir

        if not self.rt.is_main:
            return
        cfg = self.cfg
        root = WeightUpdateMeta.from_disk(cfg.experiment_name, cfg.trial_name, cfg.cluster.fileroot).path
        if root is None or not root.exists():
            return
        for v in list_versions(root):
            if v > start:
                shutil.rmtree(version_dir(root, v))

    def _sleeps_while_training(self) -> bool:
        """Whether the rollout engine frees its KV cache during training: when it shares the trainer's
        GPU (the native engine; servers run on GPUs of their own), nothing generates meanwhile
        (`rollout.max_head_offpolicyness: 0`) and `native.free_kv_while_training` says so."""
        if not (
            self.rt.device.type == "cuda"
            and self.rollout_device == self.rt.device
            and self.cfg.rollout.max_head_offpolicyness == 0
            and not self._serves()
        ):
            return False
        mode = self.cfg.native.free_kv_while_training
        if mode == "auto" and not self._sleep_releases_weights():
            return self._kv_stays is not True
        return mode != "never"

    def _decide_kv_stays(self) -> None:
        """`native.free_kv_while_training: auto`, after a step trained with the cache freed: the cache stays
        from now on when that step's peak plus the cache fits in `HEADROOM` of the GPU on every rank (freeing
        and allocating it again, with its CUDA graphs recaptured, costs time every step)."""
        from laden.memory.auto import HEADROOM, process_gpu_bytes

        device = self.rt.device
        peak = torch.cuda.max_memory_reserved(device)
        cache = self.rollout.sleep_frees_bytes()
        budget = process_gpu_bytes(device) * HEADROOM
        fits = cache is not None and peak + cache <= budget
        self._kv_stays = not self.rt.any_rank(not fits)
        if cache is not None:
            log.info(
                "native.free_kv_while_training=auto: training peak %.2f GiB + KV cache %.2f GiB %s %.0f%% of "
                "the GPU (%.2f GiB): the cache %s during training", peak / 2**30, cache / 2**30,
                "fit in" if fits else "exceed", HEADROOM * 100, budget / 2**30,
                "stays" if self._kv_stays else "is freed",
            )  # fmt: skip

    def _serves(self) -> bool:
        """Whether the rollout engine is servers of its own (vLLM, SGLang), not an engine in this process."""
        return not self.rollout_backend.in_process

    def _sleep_releases_weights(self) -> bool:
        """Whether the rollout engine frees its weights too when it sleeps during training: beside a
        trainer that keeps the policy in host memory (roundpipe; the update after the step refills them)."""
        return self.rt.backend.keeps_policy_on_host

    def _update_source(self, dtype: torch.dtype | None = None, device: str | None = None):
        """What a weight update sends: every weight, or under `actor.use_lora`, to the native engine that
        holds the others (loaded from `actor.path`), only the adapted projections, merged, as a
        `PartialUpdate` (servers reload whole directories; released weights need all)."""
        from laden.weights import PartialUpdate

        partial = self.cfg.actor.use_lora and self.rollout_backend.accepts_partial_updates
        if partial and not (self._sleep_releases_weights() and self._sleeps_while_training()):
            return PartialUpdate(self.engine.named_weights(dtype, device=device, trained_only=True))
        return self.engine.named_weights(dtype, device=device)

    async def _push_weights(self, version: int) -> None:
        """The trainer's weights to the rollout engine, as `actor.weight_update_mode` says.

        `disk`: a version directory under the run directory (written atomically, shards of
        `actor.weight_chunked_mem_mb`), which the engine loads. `xccl` with the native engine in this
        process: the tensors are copied in place (one process needs no broadcast); with servers: a
        broadcast from rank 0 (`_push_through_broadcast`). An in-place
        update that runs out of memory, under `oom_policy: auto` in one process, is made again
        through disk (the engine then reads every tensor from the version directory, so a copy
        the failure left half done is overwritten): the same weights, no GPU staging."""
        from laden.weights import WeightUpdateMeta

        cfg = self.cfg
        if cfg.actor.weight_update_mode == "disk":
            await self._push_through_disk(WeightUpdateMeta.from_config(cfg), version)
            return
        if self._serves():
            await self._push_through_broadcast(version)
            return
        try:
            await self.rollout.update_weights(self._update_source(), version=version)
        except Exception as exc:
            if not (
                is_oom(exc) and cfg.oom_policy == "auto" and self.rt.world_size == 1 and not self._serves()
            ):
                raise
            log.warning(
                "weight update %d ran out of memory in place (%s); oom_policy=auto: making it again through "
                "disk under the run directory", version, str(exc).splitlines()[0][:200],
            )  # fmt: skip
            release_cached_memory()
            meta = WeightUpdateMeta.from_disk(
                cfg.experiment_name, cfg.trial_name, cfg.cluster.fileroot,
                weight_chunked_mem_mb=cfg.actor.weight_chunked_mem_mb,
            )  # fmt: skip
            await self._push_through_disk(meta, version)

    async def _push_through_broadcast(self, version: int) -> None:
        """`xccl` to rollout servers: every rank gathers the full weights in the compute dtype, one tensor at a
        time, as the disk path does, and rank 0, which drives the servers, broadcasts them in buckets of
        `actor.weight_chunked_mem_mb` over a group of its own with every server's workers
        (`laden.rollout.servers.broadcast`: NCCL on GPUs, gloo on the CPU); a failed broadcast raises
        `WeightBroadcastError` and the run stops."""
        from laden.weights import default_backend

        cfg = self.cfg
        backend = default_backend()
        named = self._update_source(torch_dtype(cfg.actor.dtype), device="cpu" if backend == "gloo" else None)
        loop = asyncio.get_running_loop()
        served_by_rank_zero = isinstance(self.rollout, ServedByRankZero)
        if served_by_rank_zero:
            # sharded engines gather collectively: every rank iterates, rank 0 broadcasts
            await loop.run_in_executor(self.train_pool, lambda: [None for _ in named])
        else:
            if self._server_channel is None:
                from laden.rollout.servers.broadcast import ServerChannel

                self._server_channel = ServerChannel(
                    self.rollout.urls, tp=self.rollout_backend.mode.tp,
                    bucket_mb=cfg.actor.weight_chunked_mem_mb, backend=backend,
                )  # fmt: skip
            t0 = time.perf_counter()
            update = self._server_channel.update(named, executor=self.train_pool)
            await self.rollout.update_weights(update, version)
            log.info(
                "weight version %d broadcast to the servers in %.2f s", version, time.perf_counter() - t0
            )
        await loop.run_in_executor(self.train_pool, self.rt.barrier)
        if served_by_rank_zero:  # rank 0 loaded the servers: the version advances
            await self.rollout.update_weights(None, version)

    def _close_server_channel(self) -> None:
        """Release the trainer's end of the broadcast group with the servers (if one was made)."""
        if self._server_channel is not None:
            self._server_channel.close()
            self._server_channel = None

    async def _push_through_disk(self, meta: Any, version: int) -> None:
        from laden.weights import version_dir, write_weights

        cfg = self.cfg
        root = meta.path
        assert root is not None
        named = self._update_source(torch_dtype(cfg.actor.dtype), device="cpu")
        # a resumed run's first push: its checkpoint's version is on disk already
        exists = version_dir(root, version).is_dir()

        def publish() -> None:
            if not exists and self.rt.is_main:
                write_weights(named, root, version, shard_mb=cfg.actor.weight_chunked_mem_mb, keep_last=2)
            elif not exists:  # sharded engines gather collectively: every rank iterates, rank 0 writes
                for _ in named:
                    pass
            self.rt.barrier()

        await asyncio.get_running_loop().run_in_executor(self.train_pool, publish)
        # servers load a directory of safetensors; the native engine finds the version under the root
        source = version_dir(root, version) if self._serves() else meta
        await self.rollout.update_weights(source, version=version)

    # ------------------------------------------------------------------ training (worker thread)
