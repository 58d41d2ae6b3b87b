"""The native engine's device side: the model's prefill, a window of decode steps (CUDA graph
replays, or eager steps where no graph fits) and sampling; no scheduling (`scheduler.Scheduler`).

Decode steps sample in one Triton pass (`kernels.triton_sampler`) where the rows need no top-k /
top-p / min-token masking: its Philox key and step counter live on the device, so a window runs
with no host sync. Under tensor parallel only the leader samples: each decode step's token ids
are broadcast on the device (`next_tokens`), and a follower's runner runs the device phases the
leader sends (`follow`).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from laden.rollout.native.kernels.options import SamplerOptions
from laden.rollout.native.kv_cache import KVCache
from laden.rollout.native.model import DecodeMeta, PagedModel, PrefillMeta, triton_failed
from laden.rollout.native.sampler import SamplingTensors, sample
from laden.rollout.native.tensor_parallel import Message, TensorParallel

log = logging.getLogger(__name__)


class Runner:
    """See the module docstring. `model` runs on its device over `cache`; `seed` keys the draws."""

    def __init__(
        self,
        model: PagedModel,
        cache: KVCache,
        *,
        seed: int = 0,
        tensor_parallel: TensorParallel | None = None,
        sampler_options: SamplerOptions | None = None,
    ) -> None:
        self.model, self.cache = model, cache
        self.tp = tensor_parallel
        self.device = model.device
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.sampler_options = sampler_options or SamplerOptions()
        self.fused_sampler = bool(getattr(model, "fused_decode", False))
        if self.fused_sampler:
            self.sample_seed = torch.tensor([seed], dtype=torch.int64, device=self.device)
            self.sample_offset = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.graphs: Any = None  # set by the engine on CUDA (`laden.rollout.native.graphs.DecodeGraphs`)

    def run_prefill(
        self,
        ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        bounds: list[int],
        copies: list[tuple[int, int]],
    ) -> torch.Tensor | None:
        """The device side of a prefill (int64 token ids, positions and cache slots of the packed
        prompts): the model, then the block copies; the logits at each prompt's last token (None on
        a tensor parallel follower)."""
        dev = self.device
        lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]

        def up(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(values).to(dev, non_blocking=True)

        meta = PrefillMeta(
            positions=up(positions),
            slots=up(slots),
            cu_seqlens=torch.tensor(bounds, device=dev, dtype=torch.int32),
            bounds=bounds,
            max_len=max(lengths),
            last=torch.tensor([b - 1 for b in bounds[1:]], device=dev),
        )
        ids_d = up(ids)
        logits = self.model.prefill(ids_d, meta, self.cache.k, self.cache.v)
        for src, dst in copies:
            self.cache.copy_block(src, dst)
        return logits

    def sample(
        self, logits: torch.Tensor, st: SamplingTensors, generated: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch sampler over fp32 `logits [B, V]` with the engine's generator (a prefill's first tokens)."""
        return sample(logits, st, generated, self.generator)

    def run_decode(self, table, last, positions, generated, st: SamplingTensors, steps: int):
        """The device side of a decode window (host inputs): CUDA graph replays where a graph fits,
        eager steps otherwise; (tokens, logprobs) `[steps, B]` on the device."""
        out = None
        if self.graphs is not None and self.graphs.fits(last.shape[0]):
            out = self.graphs.run(table, last, positions, generated, st, steps, self.generator)
        return out if out is not None else self._eager_window(table, last, positions, generated, st, steps)

    def _eager_window(self, table, last, positions, generated, st_host: SamplingTensors, steps: int):
        dev = self.device
        self.model.workspace, self.model.split_pages = None, None  # the graphs' buffers are sized for them
        table = table.to(dev, non_blocking=True)  # no wait for a window in flight (chained windows)
        tokens = last.to(dev, non_blocking=True)
        positions = positions.to(dev, non_blocking=True)
        generated = generated.to(dev, non_blocking=True)
        st = _to_device(st_host, dev)
        out_t, out_lp = [], []
        bs = self.cache.block_size
        limit = self.model.max_model_len - 1
        rows = torch.arange(table.shape[0], device=dev)
        for _ in range(steps):
            pos = positions.clamp(max=limit)
            slots = table[rows, pos // bs].long() * bs + pos % bs
            meta = DecodeMeta(
                positions=pos, slots=slots, block_tables=table, context_lens=(pos + 1).to(torch.int32)
            )
            logits = self.model.decode(tokens, meta, self.cache.k, self.cache.v, cast=not self.fused_sampler)
            tokens, lp = self.next_tokens(logits, st, generated)
            out_t.append(tokens)
            out_lp.append(lp)
            positions = positions + 1
            generated = generated + 1
        return torch.stack(out_t), torch.stack(out_lp)

    def next_tokens(
        self, logits: torch.Tensor | None, st: SamplingTensors, generated: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step's sampling from the LM head's logits (fp32, or the model's dtype where the
        engine samples in one Triton pass); under tensor parallel the leader samples and broadcasts
        the token ids (followers have no logits and get zero log-probs, which nobody reads). No
        host sync."""
        if self.tp is None:
            assert logits is not None
            return self._sample_step(logits, st, generated)
        if logits is not None:
            tokens, logprobs = self._sample_step(logits, st, generated)
        else:
            tokens = torch.empty_like(generated)
            logprobs = torch.zeros(generated.shape, dtype=torch.float32, device=generated.device)
        self.tp.broadcast(tokens)
        return tokens, logprobs

    def _sample_step(
        self, logits: torch.Tensor, st: SamplingTensors, generated: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused_sampler and not st.truncate and not st.any_min_tokens:
            from laden.rollout.native.kernels.triton_sampler import sample_fused

            o = self.sampler_options
            try:
                return sample_fused(
                    logits, st.temperature, st.greedy, self.sample_seed, self.sample_offset,
                    chunk=o.chunk, num_warps=o.num_warps, method=o.method,
                )  # fmt: skip
            except Exception as e:
                if not triton_failed(e):
                    raise
                log.warning(
                    "laden's fused sampler does not build on this GPU (%s: %s); sampling in torch from now on",
                    type(e).__name__, (str(e).splitlines() or [""])[0],
                )  # fmt: skip
                self.fused_sampler = False
        return sample(logits.float(), st, generated, self.generator)

    def follow(self, message: Message) -> None:
        """Tensor parallel follower: run the device phase the leader sent (its own KV cache, its heads)."""
        if message.kind == "prefill":
            self.run_prefill(*message.payload)
        elif message.kind == "decode":
            self.run_decode(*message.payload)
        else:
            raise RuntimeError(
                f"a tensor parallel follower's core runs prefill and decode, not {message.kind!r}"
            )


def _to_device(st: SamplingTensors, dev: torch.device) -> SamplingTensors:
    if st.temperature.device == dev:
        return st
    return SamplingTensors(
        temperature=st.temperature.to(dev, non_blocking=True), greedy=st.greedy.to(dev, non_blocking=True),
        top_k=st.top_k.to(dev, non_blocking=True), top_p=st.top_p.to(dev, non_blocking=True),
        min_tokens=st.min_tokens.to(dev, non_blocking=True), stop_ids=st.stop_ids.to(dev, non_blocking=True),
        truncate=st.truncate, any_min_tokens=st.any_min_tokens,
    )  # fmt: skip
