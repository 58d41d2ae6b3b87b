"""CUDA graphs of the decode step, one per batch size of a fixed set.

A decode step of a small model is hundreds of kernel launches of a few microseconds each; on a
GPU the launches, not the kernels, would bound it. Each graph replays one whole step: the
model's forward for the batch's last tokens, sampling, and the advance of the step's state on
the device (next input = the sampled token, positions and lengths + 1, cache slots from the
block tables), so a window is `decode_steps` replays with no host work between them.

A batch runs in the smallest captured size that holds it; the padding rows point at the KV
sink block, so they compute garbage that nobody reads. Graphs read their inputs from static
buffers (written once per window) and write the sampled tokens and log-probs to static
outputs, copied out after each replay. A graph holds the addresses of the weights and the KV
cache: after either is reallocated (`sleep` / `wake`, or the fused projections made again) they
are captured again. Graphs for top-k / top-p or `min_new_tokens` rows are captured when a batch
first needs them. Under tensor parallel every rank captures its own graphs, the layers'
all-reduces and the step's token broadcast inside them (NCCL collectives are capturable); the
ranks capture and replay the same sizes in the same order, since they run the same windows.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from laden.rollout.native.model import DecodeMeta
from laden.rollout.native.sampler import SamplingTensors

log = logging.getLogger(__name__)

STOP_WIDTH = 16


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8, 16, 24, 32, 48, 64) if s < max_batch]
    s = 96
    while s < max_batch:
        sizes.append(s)
        s += 32 if s < 256 else 64
    return [*sizes, max_batch]


class DecodeGraphs:
    """Captured decode steps (see the module docstring) of `runner`'s model and sampling. Build with
    `capture(runner, max_batch=)`."""

    def __init__(self, runner, max_batch: int) -> None:
        self.runner = runner
        self.model = runner.model
        self.max_batch = max_batch
        self.sizes = capture_sizes(max_batch)
        dev = runner.device
        n = max_batch
        self.max_blocks = runner.cache.blocks_for(self.model.max_model_len)
        self.tokens = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.generated = torch.zeros(n, dtype=torch.long, device=dev)
        self.table = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.out_lp = torch.zeros(n, dtype=torch.float32, device=dev)
        self.st = SamplingTensors(
            temperature=torch.ones(n, device=dev), greedy=torch.zeros(n, dtype=torch.bool, device=dev),
            top_k=torch.zeros(n, dtype=torch.long, device=dev), top_p=torch.ones(n, device=dev),
            min_tokens=torch.zeros(n, dtype=torch.long, device=dev),
            stop_ids=torch.full((n, STOP_WIDTH), -1, dtype=torch.long, device=dev), truncate=False, any_min_tokens=False,
        )  # fmt: skip
        self.graphs: dict[tuple[int, bool, bool], torch.cuda.CUDAGraph] = {}
        self.pool: Any = None
        self.epoch = -1  # the model's weights_epoch the graphs were captured at
        self.num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self.workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.model.decode_backend == "triton":  # the split partials of the largest launch
            from laden.rollout.native.kernels.triton_decode import workspace_rows

            hq, d, page = self.model.num_heads, self.model.head_dim, runner.cache.block_size
            options = self.model.kernel_options.decode
            rows = max(
                workspace_rows(s, self.model.num_kv_heads, self.max_blocks, page, self.num_sms, options)
                for s in self.sizes
            )
            self.workspace = (
                torch.empty(rows * hq * d, device=dev, dtype=torch.float32),
                torch.empty(rows * hq, device=dev, dtype=torch.float32),
            )

    @classmethod
    def capture(cls, runner, *, max_batch: int) -> DecodeGraphs:
        graphs = cls(runner, max_batch)
        graphs.recapture()
        return graphs

    def release(self) -> None:
        self.graphs.clear()
        self.pool = None
        self.model.workspace = None

    def recapture(self) -> None:
        """Capture the plain-sampling graph of every size, largest first (they share one pool)."""
        self.release()
        self.model.fused_weights()  # made before the first capture: every graph holds the same buffers
        for size in reversed(self.sizes):
            self._capture(size, False, False)
        self.epoch = self.model.weights_epoch
        log.info("captured %d decode graphs (batch sizes %s)", len(self.graphs), self.sizes)

    def fits(self, batch: int) -> bool:
        return batch <= self.max_batch

    def _step(self, size: int) -> None:
        model, bs = self.model, self.runner.cache.block_size
        rows = torch.arange(size, device=self.tokens.device)
        pos = self.positions[:size].clamp(max=model.max_model_len - 1)
        slots = self.table[:size][rows, pos // bs].long() * bs + pos % bs
        meta = DecodeMeta(
            positions=pos, slots=slots, block_tables=self.table[:size], context_lens=(pos + 1).to(torch.int32)
        )
        logits = model.decode(
            self.tokens[:size],
            meta,
            self.runner.cache.k,
            self.runner.cache.v,
            cast=not self.runner.fused_sampler,
        )
        tokens, lp = self.runner.next_tokens(logits, self._st(size), self.generated[:size])
        self.tokens[:size].copy_(tokens)
        self.out_lp[:size].copy_(lp)
        self.positions[:size].add_(1)
        self.generated[:size].add_(1)

    def _st(self, size: int) -> SamplingTensors:
        return self.st

    def _capture(self, size: int, truncate: bool, min_tokens: bool) -> torch.cuda.CUDAGraph:
        if self.workspace is not None:
            from laden.rollout.native.kernels.triton_decode import split_pages_for

            page = self.runner.cache.block_size
            self.model.split_pages = split_pages_for(
                size,
                self.model.num_kv_heads,
                self.max_blocks,
                page,
                self.num_sms,
                self.model.kernel_options.decode,
            )
        self.model.workspace = self.workspace
        self.st.truncate, self.st.any_min_tokens = truncate, min_tokens
        saved = [t.clone() for t in (self.tokens, self.positions, self.generated)]
        self.table.zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels
                self._step(size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        gen = self.runner.generator
        if gen is not None and hasattr(graph, "register_generator_state"):
            graph.register_generator_state(gen)
        # thread_local: another thread (a colocated trainer) may use the GPU while this one captures
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self._step(size)
        if self.pool is None:
            self.pool = graph.pool()
        for t, s in zip((self.tokens, self.positions, self.generated), saved):
            t.copy_(s)
        self.graphs[(size, truncate, min_tokens)] = graph
        return graph

    def run(self, table, last, positions, generated, st_host: SamplingTensors, steps: int, generator):
        """One window of `steps` decode steps for `len(last)` rows; (tokens, logprobs) `[steps, B]`."""
        b = last.shape[0]
        self.model.fused_weights()
        if self.epoch != self.model.weights_epoch:  # the fused weights were made again since capture
            self.recapture()
        size = next(s for s in self.sizes if s >= b)
        key = (size, st_host.truncate, st_host.any_min_tokens)
        if st_host.stop_ids.shape[1] > STOP_WIDTH:
            return None  # more stop ids than the static buffer holds: the eager path
        self.table.zero_()
        self.table[:b].copy_(table, non_blocking=True)
        for buf, src in ((self.tokens, last), (self.positions, positions), (self.generated, generated)):
            buf.zero_()
            buf[:b].copy_(src, non_blocking=True)
        self.st.temperature.fill_(1.0)
        self.st.greedy.fill_(False)
        self.st.top_k.fill_(0)
        self.st.top_p.fill_(1.0)
        self.st.min_tokens.fill_(0)
        self.st.copy_(st_host)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(size, *key[1:])
            # capture ran warm-up steps on the buffers: write the window's inputs again
            return self.run(table, last, positions, generated, st_host, steps, generator)
        self.model.split_pages = None  # eager calls outside graphs (prefill needs none)
        out_t = torch.empty(steps, b, dtype=torch.long, device=self.tokens.device)
        out_lp = torch.empty(steps, b, dtype=torch.float32, device=self.tokens.device)
        for j in range(steps):
            graph.replay()
            out_t[j].copy_(self.tokens[:b])
            out_lp[j].copy_(self.out_lp[:b])
        return out_t, out_lp
