"""`NativeEngine`: the embedded rollout engine (`rollout.backend: native:d1`), needing only PyTorch.

It wraps `GenerationCore` (a `Scheduler` and a `Runner`: paged KV cache, decode windows) in the async
`RolloutEngine` protocol. All device work runs in one worker thread, one window at a time, so
the event loop stays free for the caller (an RL trainer's rollout workflows) while the GPU
decodes; `pause()` waits for the window in progress to end (a token boundary), and weight
updates, `sleep` and `wake` run between windows in the same thread.

Memory (`sizing`): on CUDA the engine reserves `mem_fraction_static` of the GPU's memory for its weights
plus the KV cache (SGLang's meaning of the knob); what a profiling pass at the largest prefill
and decode batch needs for activations is kept out of the cache. On the CPU the cache holds
`max_concurrent` sequences of `max_model_len` tokens unless `kv_cache_tokens` says otherwise.

Weights: the engine's model is a `transformers` causal LM whose parameters it owns; an update
copies the new tensors into them in place, by Hugging Face name (`weight_update`), so there is
never a second copy of the model on the device. The sequences in flight at an update keep their
tokens and leave the KV cache: their keys and values are recomputed under the new weights (one
prefill of prompt plus tokens so far) when they continue, so a resumed completion is exactly
what the new weights produce from its prefix. `sleep(weights=True)` frees them too (a
colocated trainer holds the same weights) and the next update after `wake()` refills them.

Tensor parallel (`tensor_parallel=`, `rollout.backend: native:d1t2`): the engine's t ranks each
hold a shard of the weights (`laden.rollout.native.tensor_parallel`: the layout, and why rank 0
alone schedules) and every method is a collective call: each rank calls it in the same order
with the same arguments, an update with the full tensors (each rank slices its own). Rank 0 runs
the engine as above and sends each window's device phases; the other ranks run them
(`laden.rollout.native.follower`). Every rank's `generate` returns rank 0's completions.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from laden.rollout.base import GenerationRequest, GenerationResult
from laden.rollout.native.attention import pick_decode_backend
from laden.rollout.native.core import GenerationCore
from laden.rollout.native.driver import EngineDriver
from laden.rollout.native.kernels.options import KernelOptions
from laden.rollout.native.kv_cache import KVCache
from laden.rollout.native.model import PagedModel
from laden.rollout.native.runner import Runner
from laden.rollout.native.scheduler import Scheduler
from laden.rollout.native.sizing import plan_blocks
from laden.rollout.native.tensor_parallel import ShardLayout, TensorParallel
from laden.rollout.native.weight_update import EngineWeights

log = logging.getLogger(__name__)


def _eos_ids(model: nn.Module, tokenizer: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        ids += list(value) if isinstance(value, (list, tuple)) else [int(value)]
    return tuple(dict.fromkeys(ids))


class NativeEngine(EngineDriver):
    """The embedded rollout engine (see the module docstring).

    model: a Qwen3 / Qwen2 / Llama / Mistral `*ForCausalLM`, already on its device and in its
        dtype; the engine uses (and updates) its parameters.
    tokenizer: for stop strings and EOS ids (optional).
    max_concurrent: sequences in flight (`rollout.max_concurrent_rollouts`); the rest queue.
    max_model_len: longest prompt + completion; sizes the block tables and rotary table.
    decode_steps: decode steps per window between host reads (1 = check stops every token).
    max_prefill_tokens: prompt tokens one prefill may take (default 32768 on CUDA, 2048 on the CPU;
        a longer prompt is prefilled alone). The profiling pass that sizes the KV cache runs a
        prefill of this many tokens. On an H200, workload B ran at 25,477 output tokens/s with
        32768 (fewer, larger prefills: 0.51 s of prefill) and at 25,004 with 16384 (0.70 s).
    compile: run each layer's norms, projections, rotary embedding and MLP as one
        `torch.compile`'d graph per side of the attention (default: on CUDA), so a decode step is
        a few kernels per layer instead of dozens; off, the same math runs eagerly.
    tensor_parallel: this rank's group of an engine over t ranks (`tensor_parallel_groups`); the
        model may come whole (it is sharded here) or already sharded (`ShardLayout.shard_model`).
    chain_windows: launch the next decode window before the host reads the last (default: on
        CUDA without tensor parallel).
    fused_decode: decode steps run laden's Triton layer (one kernel for the q/k norms, rotary
        embedding and cache writes; split-K projections for few rows) and sample the rows without
        top-k / top-p / min-token masking in one Triton pass, instead of the compiled graphs around
        cuBLAS and the torch sampler (default: on CUDA with Triton, the standard layers, no tensor
        parallel). A kernel that does not build on the GPU (Triton's own error) turns its part off
        with a warning; the step runs again on the torch path.
    kernel_options: the Triton kernels' launch settings (default: `KernelOptions()`, the measured ones).

    The q/k/v and gate/up parameters become views of one fused tensor per layer (one projection
    each); updates copied into them by name land there.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        *,
        max_concurrent: int = 256,
        max_model_len: int = 4096,
        block_size: int | None = None,
        mem_fraction_static: float = 0.8,
        kv_cache_tokens: int | None = None,
        decode_steps: int | None = None,
        max_prefill_tokens: int | None = None,
        cuda_graphs: bool | None = None,
        decode_backend: str = "auto",
        compile: bool | None = None,
        seed: int = 0,
        tensor_parallel: TensorParallel | None = None,
        chain_windows: bool | None = None,
        fused_decode: bool | None = None,
        kernel_options: KernelOptions | None = None,
    ) -> None:
        if max_concurrent < 1:
            raise ValueError(
                f"max_concurrent={max_concurrent} must be >= 1 (rollout.max_concurrent_rollouts)"
            )
        if not 0 < mem_fraction_static <= 1:
            raise ValueError(f"native.mem_fraction_static={mem_fraction_static} must be in (0, 1]")
        model.eval()
        device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        tp = tensor_parallel if tensor_parallel is not None and tensor_parallel.size > 1 else None
        self.tp = tp
        self.kernel_options = kernel_options or KernelOptions()
        self.layout = None if tp is None else ShardLayout(model.config, rank=tp.rank, size=tp.size)
        self.paged = PagedModel(
            model,
            max_model_len=max_model_len,
            decode_backend=pick_decode_backend(device, dtype, decode_backend),
            compile=device.type == "cuda" if compile is None else compile,
            tensor_parallel=tp,
            fused_decode=fused_decode,
            kernel_options=self.kernel_options,
        )
        group_rank = 1
        if self.layout is not None:
            self.layout.shard_model(model)
            # xccl: one receiver per GPU of the rollout allocation (WeightUpdateMeta.from_fsdp_xccl)
            group_rank = 1 + dist.get_rank()
        self.weights = EngineWeights(model, device, self.layout, group_rank)
        cfg = model.config
        block_size = block_size or (32 if device.type == "cuda" else 16)
        self.block_size = block_size
        self.mem_fraction_static = mem_fraction_static
        self.max_concurrent = max_concurrent
        on_cuda = device.type == "cuda"
        self.decode_steps = decode_steps or (8 if on_cuda else 4)
        self.max_prefill_tokens = max_prefill_tokens or (32768 if on_cuda else 2048)
        self.cache_kwargs = dict(  # the KV cache's layout (`KVCache`'s arguments)
            num_layers=cfg.num_hidden_layers, block_size=block_size, kv_heads=self.paged.num_kv_heads,
            head_dim=self.paged.head_dim, dtype=dtype, device=device,
        )  # fmt: skip
        num_blocks = plan_blocks(self, kv_cache_tokens)
        cache = KVCache(num_blocks=num_blocks, **self.cache_kwargs)  # type: ignore[arg-type]
        scheduler = Scheduler(
            cache, max_model_len=max_model_len, max_concurrent=max_concurrent, decode_steps=self.decode_steps,
            max_prefill_tokens=self.max_prefill_tokens, eos_token_ids=_eos_ids(model, tokenizer),
            tokenizer=tokenizer, mem_fraction_static=mem_fraction_static,
        )  # fmt: skip
        runner = Runner(
            self.paged, cache, seed=seed, tensor_parallel=tp, sampler_options=self.kernel_options.sampler
        )
        self.core = GenerationCore(
            scheduler, runner, chain_windows=on_cuda if chain_windows is None else chain_windows
        )
        self.core.may_chain = self._may_chain
        self.cuda_graphs = on_cuda if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs:
            from laden.rollout.native.graphs import DecodeGraphs

            self.core.runner.graphs = DecodeGraphs.capture(self.core.runner, max_batch=max_concurrent)
        # the worker thread's current CUDA device is the engine's (Triton and graph capture use it)
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="laden-native",
            initializer=(lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None,
        )
        self._lock: asyncio.Lock | None = None
        self._resumed: asyncio.Event | None = None
        self._work: asyncio.Event | None = None
        self._driver: asyncio.Task | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._paused = False
        self._sleeping = False
        self._closed = False
        self._waiters = 0  # callers waiting for the lock: the core launches no chained window meanwhile
        self._follower = None
        if tp is not None and not tp.is_leader:
            from laden.rollout.native.follower import Follower

            self._follower = Follower(self)
        log.info(
            "native engine: %d KV blocks of %d tokens (%.2f GiB, %d tokens), up to %d sequences, decode %s%s",
            num_blocks - 1, block_size, cache.nbytes / 2**30, (num_blocks - 1) * block_size, max_concurrent,
            self.paged.decode_backend, ", CUDA graphs" if self.cuda_graphs else "",
        )  # fmt: skip

    # ----------------------------------------------------------------- the protocol

    @property
    def version(self) -> int:
        return self.core.version

    @property
    def max_model_len(self) -> int:
        """Longest prompt plus completion the engine holds (a prompt must be shorter)."""
        return self.paged.max_model_len

    async def generate(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[GenerationResult]:
        """Results as they finish (see `RolloutEngine.generate`)."""
        if self._closed:
            raise RuntimeError("the native engine is closed")
        if self.weights.released:
            raise RuntimeError(
                "the native engine's weights were released by sleep(weights=True): call "
                "update_weights(source, version) after wake() before generating"
            )
        if self._follower is not None:
            async for result in self._follower.generate(requests):
                yield result
            return
        self._ensure_loop_state()
        assert self._work is not None
        rids = [r.rid for r in requests]
        if len(set(rids)) != len(rids) or any(rid in self._queues for rid in rids):
            raise ValueError("request ids must be unique among the requests in flight")
        queue: asyncio.Queue = asyncio.Queue()
        expected = sum(r.n_samples for r in requests)
        async with self._exclusive():
            for r in requests:  # `add` checks each request first, so a bad one adds none of them
                self.core.check(r)
            for r in requests:
                self.core.add(r)
                self._queues[r.rid] = queue
        self._work.set()
        if self._driver is None or self._driver.done():
            self._driver = asyncio.ensure_future(self._drive())
        try:
            for _ in range(expected):
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            for rid in rids:
                self._queues.pop(rid, None)

    async def generate_all(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Every result, ordered by request then sample index."""
        order = {r.rid: i for i, r in enumerate(requests)}
        out = [r async for r in self.generate(requests)]
        return sorted(out, key=lambda r: (order[r.rid], r.sample_index))

    def generate_sync(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """`generate_all` from synchronous code (its own event loop)."""
        return asyncio.run(self._generate_and_stop(requests))

    async def _generate_and_stop(self, requests):
        try:
            return await self.generate_all(requests)
        finally:
            if self._driver is not None:
                await self._driver
            if self._follower is not None:
                await self._follower.drain()
                self._follower.reset()
            self._lock = self._resumed = self._work = None
            self._driver = None

    async def pause(self) -> None:
        if self._follower is not None:
            await self._follower.call("pause")
            return
        self._ensure_loop_state()
        assert self._lock is not None and self._resumed is not None
        self._paused = True
        self._resumed.clear()
        async with self._exclusive():  # the window in progress ends first
            await self._flush()
            await self._send("pause")

    async def resume(self) -> None:
        if self._follower is not None:
            await self._follower.call("resume")
            return
        self._ensure_loop_state()
        assert self._resumed is not None
        if self.tp is not None:
            async with self._exclusive():
                await self._send("resume")
        self._paused = False
        if not self._sleeping:
            self._resumed.set()
        if not self.core.idle and (self._driver is None or self._driver.done()):
            self._driver = asyncio.ensure_future(self._drive())

    async def update_weights(self, source: Any, version: int) -> None:
        """New weights between windows (pause first for a token-exact boundary under load)."""
        if self._follower is not None:
            await self._follower.call("update", source, version)
            return
        self._ensure_loop_state()
        async with self._exclusive():
            await self._flush()
            await self.in_worker(self.apply_update, source, version)

    def apply_update(self, source: Any, version: int) -> None:
        """In the worker thread, between windows: copy `source` into the weights (see
        `EngineWeights.load`) and continue the sequences in flight under them."""
        self.core.send("update", version)  # tensor parallel leader: the followers update here too
        was_released = self.weights.released
        self.weights.load(source, version)
        # The cached keys and values of the sequences in flight came from the old weights: they are
        # prefilled again (prompt and tokens so far) under the new ones when they next run.
        self.core.requeue_running()
        graphs = self.core.runner.graphs
        if was_released:
            self.paged.rebuild_rope()
            if graphs is not None and self.core.cache.allocated:
                graphs.recapture()  # the graphs held the released weights' addresses
        self.core.version = version

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """The engine's weights by Hugging Face name (what updates are copied into)."""
        return self.weights.named_parameters()

    def sampling_state(self) -> dict[str, Any]:
        """Where the engine's random draws stand: the torch sampler's generator and the fused
        sampler's step counter (its draws are keyed by the seed and that counter, on the device).
        `load_sampling_state` continues from it (a resumed run samples what it would have)."""
        runner = self.core.runner
        state: dict[str, Any] = {"generator": runner.generator.get_state().tolist()}
        offset = getattr(runner, "sample_offset", None)
        if offset is not None:
            state["fused_step"] = int(offset.item())
        return state

    def load_sampling_state(self, state: dict[str, Any] | list[int]) -> None:
        """Continue from `sampling_state()`'s result (a bare list: a generator state alone)."""
        if isinstance(state, list):
            state = {"generator": state}
        runner = self.core.runner
        runner.generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))
        offset = getattr(runner, "sample_offset", None)
        if offset is not None and "fused_step" in state:
            offset.fill_(int(state["fused_step"]))  # in place: the CUDA graphs read this tensor

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """Synchronous in-place update (the engine idle or paused)."""
        version = self.core.version if version is None else version
        if self._follower is not None:
            self._follower.load_weights_now(named, version)
        else:
            self.apply_update(named, version)

    async def sleep(self, *, weights: bool = False) -> None:
        if self._follower is not None:
            await self._follower.call("sleep")
            return
        self._ensure_loop_state()
        async with self._exclusive():
            await self._send("sleep", weights)
            if self._sleeping:
                return
            await self._flush()
            self._sleeping = True
            assert self._resumed is not None
            self._resumed.clear()
            await self.in_worker(self.release_memory, weights)

    def sleep_frees_bytes(self) -> int:
        """The GPU bytes `sleep` frees besides the weights: the KV cache (the CUDA graphs' pool, small, is
        not counted)."""
        return self.core.cache.nbytes

    def release_memory(self, weights: bool) -> None:
        """In the worker thread: free the KV cache and graphs (and the weights with `weights`)."""
        # Sequences in flight leave the cache (they keep their tokens and are prefilled again on wake).
        self.core.requeue_running()
        if self.core.runner.graphs is not None:
            self.core.runner.graphs.release()
        self.core.cache.release_tensors()
        if weights:
            self.weights.release()
            self.paged.release_fused()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    async def wake(self) -> None:
        if self._follower is not None:
            await self._follower.call("wake")
            return
        self._ensure_loop_state()
        async with self._exclusive():
            await self._send("wake")
            if not self._sleeping:
                return
            await self.in_worker(self.restore_memory)
            self._sleeping = False
            if not self._paused:
                assert self._resumed is not None
                self._resumed.set()
        if not self.core.idle and (self._driver is None or self._driver.done()):
            self._driver = asyncio.ensure_future(self._drive())

    def restore_memory(self) -> None:
        """In the worker thread: allocate the KV cache again (and recapture the graphs, unless the
        weights are still released: the next update does)."""
        self.core.cache.allocate_tensors()
        if self.core.runner.graphs is not None and not self.weights.released:
            self.core.runner.graphs.recapture()

    async def close(self) -> None:
        """End generation: requests still in flight come back with stop reason `abort` and the tokens
        they have; the KV cache and graphs are freed."""
        if self._closed:
            return
        if self._follower is not None:
            await self._follower.call("close")
            self.shutdown()
            return
        self._closed = True
        if self._resumed is not None:
            self._resumed.set()
        if self._driver is not None:
            await asyncio.wait([self._driver])
        aborted = self._abort_pending()
        await self._send("close", results=aborted)
        self.shutdown()

    def _abort_pending(self) -> list[GenerationResult]:
        self._deliver(self.core.drain())  # what finished in the window in flight is not aborted
        aborted = [s.result() for s in self.core.abort_all()]
        self._deliver(aborted)
        return aborted

    def shutdown(self) -> None:
        """Free the device memory the engine holds (KV cache, graphs) and its worker thread, now."""
        self._closed = True
        self._executor.shutdown(wait=True)
        if self.core.runner.graphs is not None:
            self.core.runner.graphs.release()
            self.core.runner.graphs = None
        if self.core.cache.allocated:
            self.core.requeue_running()
            self.core.cache.release_tensors()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
