"""The native engine's synchronous core: scheduling, prefill, windows of decode steps, stops, OOM.

`GenerationCore.step()` runs one *window*: it admits queued sequences (up to
`max_concurrent` in flight, as many as the free KV blocks and the prefill token budget allow)
and prefills them, then runs `decode_steps` decode steps for every running sequence on the
device with no host sync in between (the sampled tokens feed the next step on the device; the
host reads the window's tokens once at its end), then checks stops and returns the completions
that finished. A sequence that stops inside a window keeps decoding until the window ends; its
extra tokens are dropped. Continuous batching is this loop: finished sequences leave at a
window's end, queued ones join at the next window's start.

Chained windows (`chain_windows`, on by default on CUDA without tensor parallel): while no
queued sequence could join, the next window is launched before the host reads the one in
flight, from its device tokens, so the GPU decodes window k+1 while the host checks window k's
stops; the host reads each window through pinned buffers and an event, not a sync of the stream.
A sequence that stops inside window k ran on speculatively in window k+1, its tokens dropped;
sequences known to reach their length limit in window k are left out of window k+1. A chain
stops (the window in flight is read and nothing new launched) when blocks are short (a chained
window never preempts) or when `may_chain` says no (the engine: a caller waits to add requests,
pause, update, sleep, wake or close). When a queued sequence could be admitted, the window in
flight is not chained: the queued sequences' prefill is built and queued behind it, the host reads
it while the prefill runs, and one window is then launched for every running sequence. `drain()`
reads the window in flight; everything that reshapes the running set (`requeue_running`,
`abort_all`) drains first.

Invariants: a running sequence's cache holds every token but its last output token, which the
next decode step feeds. Prefill always starts at position 0: a sequence that left the cache
(preempted when the blocks ran out, or re-queued after an out-of-memory error) is prefilled
again with its prompt and the tokens it has, and continues where it was. The completions of one
request (`n_samples`) are prefilled once and share the prompt's full blocks.

On an out-of-memory error in a window the core frees the window's work, halves
`max_concurrent`, puts the affected sequences back at the head of the queue and goes on; at
one sequence it raises `GenerationOOMError` with the knobs to change (nothing is lost: the
sequences keep their tokens).

Tensor parallel (`laden.rollout.native.tensor_parallel`): the leader's core runs all of the above
and sends each device phase's inputs (`send`) before running it; a follower's core runs only
the device phases it receives (`follow`). Only the leader samples: each decode step's token ids
are broadcast on the device (`next_tokens`). An out-of-memory error in a tensor parallel window
is not recovered (the other ranks wait inside the layer's all-reduce): it raises
`GenerationOOMError` with the knobs to change.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from laden.rollout.base import GenerationRequest, GenerationResult, SamplingParams, StopReason
from laden.rollout.native.kv_cache import KVCache
from laden.rollout.native.model import DecodeMeta, PagedModel, PrefillMeta, triton_failed
from laden.rollout.native.sampler import SamplingTensors, build_sampling_tensors, sample
from laden.rollout.native.tensor_parallel import Message, TensorParallel

log = logging.getLogger(__name__)


class GenerationOOMError(RuntimeError):
    """Out of GPU memory in generation with one sequence in flight: nothing left to lower."""


@dataclass(slots=True, eq=False)
class _Window:
    """A decode window launched on the device and not yet read by the host."""

    seqs: list[Sequence]  # its rows, in order (the running set when it was launched)
    steps: int
    tokens: torch.Tensor  # [steps, rows] on the device
    logprobs: torch.Tensor
    host: tuple[torch.Tensor, torch.Tensor] | None = None  # pinned copies being filled (CUDA)
    event: Any = None  # recorded after the copies (CUDA)


@dataclass(slots=True, eq=False)
class Sequence:
    request: GenerationRequest
    sample_index: int
    stop_ids: frozenset[int]
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    done: StopReason | None = None

    @property
    def params(self) -> SamplingParams:
        return self.request.sampling

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.input_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def result(self) -> GenerationResult:
        assert self.done is not None
        return GenerationResult(
            rid=self.request.rid, sample_index=self.sample_index, input_ids=self.prompt,
            output_ids=list(self.output), output_logprobs=list(self.logprobs),
            output_versions=list(self.versions), stop_reason=self.done,
        )  # fmt: skip


@dataclass(slots=True, eq=False)
class _Group:
    """Queued work: the fresh completions of one request (prefilled together) or one re-queued sequence."""

    seqs: list[Sequence]

    @property
    def fresh(self) -> bool:
        return not self.seqs[0].output

    def prefill_tokens(self) -> int:
        return self.seqs[0].num_tokens if self.fresh else sum(s.num_tokens for s in self.seqs)


class GenerationCore:
    """See the module docstring. `model` runs on its device; `cache` is sized by the caller."""

    def __init__(
        self,
        model: PagedModel,
        cache: KVCache,
        *,
        max_concurrent: int,
        decode_steps: int,
        max_prefill_tokens: int,
        eos_token_ids: tuple[int, ...] = (),
        tokenizer=None,
        seed: int = 0,
        oom_hook: Callable[[str, int], None] | None = None,
        tensor_parallel: TensorParallel | None = None,
        chain_windows: bool = False,
    ) -> None:
        self.model, self.cache = model, cache
        self.tp = tensor_parallel
        self._unsent: list[GenerationResult] = []  # tensor parallel leader: results for the next message
        self.max_concurrent = max_concurrent
        self.concurrency_limit = max_concurrent  # as configured (an OOM lowers `max_concurrent` only)
        self.decode_steps = decode_steps
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids = tuple(eos_token_ids)
        self.tokenizer = tokenizer
        self.version = 0
        self.waiting: deque[_Group] = deque()
        self.running: list[Sequence] = []
        self.device = model.device
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        # decode steps sample in one Triton pass (`triton_sampler`) where the rows need no top-k /
        # top-p / min-token masking: its Philox key and step counter live on the device
        self.fused_sampler = bool(getattr(model, "fused_decode", False))
        if self.fused_sampler:
            self.sample_seed = torch.tensor([seed], dtype=torch.int64, device=self.device)
            self.sample_offset = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.oom_hook = oom_hook  # tests: called as (phase, batch size) before each device phase
        self.graphs: Any = None  # set by the engine on CUDA (`laden.rollout.native.graphs.DecodeGraphs`)
        self.chain_windows = chain_windows and tensor_parallel is None
        self.may_chain: Callable[[], bool] | None = None  # the engine: False while someone waits for it
        self._inflight: _Window | None = None
        self._ready: list[GenerationResult] = []  # finished while draining, returned by the next step
        self.stats: dict[str, float] = {
            "windows": 0, "prefill_tokens": 0, "decode_steps": 0, "preempted": 0, "oom_retries": 0,
            "prefill_s": 0.0, "decode_launch_s": 0.0, "decode_wait_s": 0.0, "host_s": 0.0, "chained": 0,
            "overlapped": 0,
        }  # fmt: skip
        """Counts, and seconds of wall time: prefill (to its sampled tokens on the host), decode
        launch (graph replays or eager steps queued), decode wait (the window's one host read),
        host (building the window's inputs, stop checks and bookkeeping); `chained`: windows
        launched before the host read the one before; `overlapped`: prefills queued behind a
        window in flight."""

    # ----------------------------------------------------------------- queue

    def check(self, request: GenerationRequest) -> None:
        """Raise `ValueError` (naming the request and the fix) for a request this engine cannot run."""
        params = request.sampling
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"request {request.rid!r} has stop strings {params.stop!r} but the engine has no tokenizer; "
                "give the engine the model's tokenizer, or use stop_token_ids"
            )
        if request.n_samples > self.concurrency_limit:
            raise ValueError(
                f"request {request.rid!r}: n_samples={request.n_samples} completions are more than the engine runs "
                f"at once (max_concurrent={self.concurrency_limit}, rollout.max_concurrent_rollouts); raise it to at "
                "least gconfig.n_samples, or lower n_samples"
            )
        if len(request.input_ids) >= self.model.max_model_len:
            raise ValueError(
                f"request {request.rid!r}: the prompt has {len(request.input_ids)} tokens, the engine's context "
                f"is {self.model.max_model_len} (max_model_len); shorten the prompt or raise max_model_len"
            )

    def add(self, request: GenerationRequest) -> None:
        """Queue `request` (its `n_samples` completions as one group: the prompt is prefilled once)."""
        self.check(request)
        params = request.sampling
        stop = frozenset() if params.ignore_eos else frozenset((*self.eos_token_ids, *params.stop_token_ids))
        seqs = [Sequence(request=request, sample_index=i, stop_ids=stop) for i in range(request.n_samples)]
        self.waiting.append(_Group(seqs))

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self._ready

    @property
    def num_pending(self) -> int:
        return sum(len(g.seqs) for g in self.waiting) + len(self.running)

    # ----------------------------------------------------------------- one window

    def step(self) -> list[GenerationResult]:
        """Admit, prefill, decode one window; the completions that finished in it.

        With a window in flight (chained windows) it launches the next one first when it may,
        then reads the one in flight. When queued sequences can join, the window just launched is
        left in flight instead, and the next step builds and queues their prefill behind it before
        reading it (the GPU does not wait for the host's prefill work), then launches a window for
        every running sequence."""
        finished: list[Sequence] = []
        admitted: list[_Group] = []
        try:
            if self._inflight is None:
                admitted = self._admit()
                if admitted:
                    self._timed_prefill(admitted, finished)
                if self.running:
                    self._inflight = self._launch_window(finished)
                if self._inflight is not None and not self._joinable(self._inflight):
                    self._advance(finished)
            elif self._joinable(self._inflight):
                admitted = self._admit(self._staying(self._inflight))

                def read() -> None:  # while the prefill runs on the GPU (in flight until then: an
                    # out-of-memory error in the prefill reads it first, its tokens kept)
                    assert self._inflight is not None
                    window, self._inflight = self._inflight, None
                    self._read_window(window, finished)

                if admitted:
                    self._timed_prefill(admitted, finished, then=read)
                    self.stats["overlapped"] += 1
                else:
                    read()
                if self.running:
                    self._inflight = self._launch_window(finished)
            else:
                self._advance(finished)
        except torch.OutOfMemoryError as e:
            if self.tp is None:
                self._settle()  # a window in flight is read first: its tokens are kept
                self._recover_from_oom(e, admitted)
            else:
                self._strand(admitted)
                raise GenerationOOMError(
                    f"out of GPU memory in a tensor parallel window (not recovered: every rank takes part in "
                    f"each layer). {self.oom_advice(self.num_pending)}"
                ) from e
        except BaseException:
            self._inflight = None  # its tokens are dropped; the sequences keep the ones read before
            self._strand(admitted)
            raise
        self.stats["windows"] += 1
        results, self._ready = self._ready + [s.result() for s in finished], []
        if self.tp is not None:
            self._unsent += results
        return results

    def drain(self) -> list[GenerationResult]:
        """Read the window in flight (if any); the completions finished since the last `step`."""
        self._settle()
        results, self._ready = self._ready, []
        return results

    def _settle(self) -> None:
        """Read the window in flight; its finished completions wait in `_ready`."""
        if self._inflight is None:
            return
        window, self._inflight = self._inflight, None
        done: list[Sequence] = []
        self._read_window(window, done)
        self._ready += [s.result() for s in done]

    def _may_chain(self) -> bool:
        return self.chain_windows and (self.may_chain is None or self.may_chain())

    def _staying(self, window: _Window) -> int:
        """Running sequences that still decode after `window` (the others end at their length limit in it)."""
        return sum(1 for s in self.running if self._remaining(s) > window.steps)

    def _joinable(self, window: _Window) -> bool:
        """Whether queued sequences may join while `window` is in flight: a free place after it and
        chaining allowed."""
        return bool(self.waiting) and self._may_chain() and self._staying(window) < self.max_concurrent

    def _advance(self, finished: list[Sequence]) -> None:
        """Launch the next window from the one in flight when it may (`_chain`), then read that one."""
        assert self._inflight is not None
        nxt = self._chain(self._inflight) if self._may_chain() else None
        window, self._inflight = self._inflight, nxt
        self._read_window(window, finished)

    def _timed_prefill(self, groups: list[_Group], finished: list[Sequence], then=None) -> None:
        t0 = time.perf_counter()
        self._prefill(groups, finished, then)
        self.stats["prefill_s"] += time.perf_counter() - t0

    def _strand(self, admitted: list[_Group]) -> None:
        """After a failed window: its sequences give their blocks back and are put back at the head of
        the queue (their tokens kept), so the engine stays consistent for `abort_all` or a retry."""
        seen = {id(s) for s in self.running}
        stranded = list(self.running) + [
            s for g in admitted for s in g.seqs if id(s) not in seen and s.blocks
        ]
        self.running = []
        self._requeue([s for s in stranded if s.done is None])

    # ----------------------------------------------------------------- tensor parallel

    def send(self, kind: str, payload: Any = None, results: list[GenerationResult] | None = None) -> None:
        """Leader: a message to the followers, with the results finished since the last one. A no-op
        without tensor parallel and on a follower."""
        if self.tp is None or not self.tp.is_leader:
            return
        unsent, self._unsent = self._unsent + (results or []), []
        self.tp.send(Message(kind, payload, unsent))

    def follow(self, message: Message) -> None:
        """Follower: run the device phase the leader sent (its own KV cache, its heads)."""
        if message.kind == "prefill":
            self.run_prefill(*message.payload)
        elif message.kind == "decode":
            self.run_decode(*message.payload)
            self.stats["windows"] += 1
        else:
            raise RuntimeError(
                f"a tensor parallel follower's core runs prefill and decode, not {message.kind!r}"
            )

    def next_tokens(
        self, logits: torch.Tensor | None, st: SamplingTensors, generated: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step's sampling from the LM head's logits (fp32, or the model's dtype where the
        engine samples in one Triton pass); under tensor parallel the leader samples and broadcasts
        the token ids (followers have no logits and get zero log-probs, which nobody reads). No
        host sync."""
        if self.tp is None:
            assert logits is not None
            return self._sample(logits, st, generated)
        if logits is not None:
            tokens, logprobs = self._sample(logits, st, generated)
        else:
            tokens = torch.empty_like(generated)
            logprobs = torch.zeros(generated.shape, dtype=torch.float32, device=generated.device)
        self.tp.broadcast(tokens)
        return tokens, logprobs

    def _sample(
        self, logits: torch.Tensor, st: SamplingTensors, generated: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused_sampler and not st.truncate and not st.any_min_tokens:
            from laden.rollout.native.kernels.triton_sampler import sample_fused

            try:
                return sample_fused(logits, st.temperature, st.greedy, self.sample_seed, self.sample_offset)
            except Exception as e:
                if not triton_failed(e):
                    raise
                log.warning(
                    "laden's fused sampler does not build on this GPU (%s: %s); sampling in torch from now on",
                    type(e).__name__, (str(e).splitlines() or [""])[0],
                )  # fmt: skip
                self.fused_sampler = False
        return sample(logits.float(), st, generated, self.generator)

    def _admit(self, in_flight: int | None = None) -> list[_Group]:
        """Queued groups to prefill now, in order, while places (`in_flight` of `max_concurrent`
        taken: the running sequences unless given), blocks and the prefill token budget allow."""
        admitted: list[_Group] = []
        budget = self.max_prefill_tokens
        in_flight = len(self.running) if in_flight is None else in_flight
        while self.waiting:
            group = self.waiting[0]
            n = len(group.seqs)
            tokens = group.prefill_tokens()
            if in_flight + n > self.max_concurrent and in_flight > 0:
                break
            if admitted and tokens > budget:
                break
            if not self._reserve(group):
                if not self.running and not admitted:  # nothing else holds blocks
                    raise RuntimeError(
                        f"request {group.seqs[0].request.rid!r} needs more KV cache than the engine has "
                        f"({self.cache.allocator.capacity} blocks of {self.cache.block_size} tokens); raise "
                        "native.mem_fraction_static or lower gconfig.max_new_tokens / n_samples"
                    )
                break
            self.waiting.popleft()
            admitted.append(group)
            in_flight += n
            budget -= tokens
        return admitted

    def _reserve(self, group: _Group) -> bool:
        """Blocks for the group's prefill plus one decode window (shared prompt blocks counted once)."""
        alloc, bs = self.cache.allocator, self.cache.block_size
        ahead = self.decode_steps + 1
        if group.fresh:
            plen = group.seqs[0].num_tokens
            full = plen // bs
            per_seq = self.cache.blocks_for(plen + ahead) - full
            need = full + per_seq * len(group.seqs)
            if need > alloc.num_free:
                return False
            shared = alloc.allocate(full)
            for i, s in enumerate(group.seqs):
                s.blocks = (shared if i == 0 else alloc.share(shared)) + alloc.allocate(per_seq)
            return True
        need = sum(self.cache.blocks_for(s.num_tokens + ahead) for s in group.seqs)
        if need > alloc.num_free:
            return False
        for s in group.seqs:
            s.blocks = alloc.allocate(self.cache.blocks_for(s.num_tokens + ahead))
        return True

    def _slots(self, blocks: list[int], n: int) -> np.ndarray:
        """The cache slots of a sequence's first `n` tokens (int64)."""
        bs = self.cache.block_size
        pages = np.asarray(blocks[: -(-n // bs)], dtype=np.int64)
        return (pages[:, None] * bs + np.arange(bs)).reshape(-1)[:n]

    def _prefill(
        self, groups: list[_Group], finished: list[Sequence], then: Callable[[], None] | None = None
    ) -> None:
        """Prefill `groups` and sample each completion's first token; `then` runs once the device
        work is queued, before the host waits for the sampled tokens."""
        ids: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        bounds = [0]
        rows: list[list[Sequence]] = []  # the sequences that sample from each prefilled row
        for g in groups:
            lead = g.seqs[0]
            for s in [lead] if g.fresh else g.seqs:
                n = s.num_tokens
                ids += [np.asarray(s.prompt, dtype=np.int64), np.asarray(s.output, dtype=np.int64)]
                slots.append(self._slots(s.blocks, n))
                bounds.append(bounds[-1] + n)
                rows.append(g.seqs if g.fresh else [s])
        positions = np.concatenate([np.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])])
        # in numpy: a Python loop per token took milliseconds a prefill
        ids_np, slots_np = np.concatenate(ids), np.concatenate(slots)
        if self.oom_hook is not None:
            self.oom_hook("prefill", len(bounds) - 1)
        dev = self.device
        copies = self._partial_block_copies(rows)
        self.send("prefill", (ids_np, positions, slots_np, bounds, copies))
        logits = self.run_prefill(ids_np, positions, slots_np, bounds, copies)
        assert logits is not None
        self.stats["prefill_tokens"] += bounds[-1]
        expanded = [r for r, seqs in enumerate(rows) for _ in seqs]  # completions of a prompt share its row
        flat = [s for seqs in rows for s in seqs]
        st = build_sampling_tensors([(s.params, s.stop_ids) for s in flat], dev)
        generated = torch.tensor([len(s.output) for s in flat], device=dev)
        row_logits = logits[torch.tensor(expanded, device=dev)]
        sampled, sampled_lp = sample(row_logits, st, generated, self.generator)
        if then is not None:
            then()
        tokens_h, logprobs_h = sampled.tolist(), sampled_lp.tolist()
        for s, t, lp in zip(flat, tokens_h, logprobs_h):
            self.running.append(s)
            self._append(s, t, lp)
        self._retire(finished)

    def _partial_block_copies(self, rows: list[list[Sequence]]) -> list[tuple[int, int]]:
        """(source, destination) blocks: completions that share a prompt copy its partial last block."""
        bs = self.cache.block_size
        copies = []
        for seqs in rows:
            lead = seqs[0]
            if len(seqs) > 1 and lead.num_tokens % bs:
                partial = lead.num_tokens // bs
                copies += [(lead.blocks[partial], s.blocks[partial]) for s in seqs[1:]]
        return copies

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

    def _append(self, s: Sequence, token: int, logprob: float) -> None:
        s.output.append(token)
        s.logprobs.append(logprob)
        s.versions.append(self.version)
        n = len(s.output)
        if (
            token in s.stop_ids
            and n >= s.params.min_new_tokens
            or (
                s.params.stop
                and not s.params.ignore_eos
                and n >= s.params.min_new_tokens
                and self._stop_string(s)
            )
        ):
            s.done = "stop"
        elif n >= s.params.max_new_tokens or s.num_tokens >= self.model.max_model_len:
            s.done = "length"

    def _stop_string(self, s: Sequence) -> bool:
        """Whether the text of the output ends a stop string at its last token (decoded tail only)."""
        longest = max(len(x) for x in s.params.stop)
        tail = self.tokenizer.decode(s.output[-(longest + 8) :])
        before = self.tokenizer.decode(s.output[-(longest + 8) : -1])
        return any(x in tail and x not in before for x in s.params.stop)

    def _retire(self, finished: list[Sequence]) -> None:
        keep = []
        for s in self.running:
            if s.done is None:
                keep.append(s)
            else:
                self.cache.allocator.free(s.blocks)
                s.blocks = []
                finished.append(s)
        self.running = keep

    def _ensure_blocks(self, steps: int) -> None:
        """Every running sequence gets blocks for `steps` more tokens; the newest ones are preempted
        (back to the head of the queue, to be prefilled again) while blocks are short."""
        alloc = self.cache.allocator
        while True:
            need = [max(0, self.cache.blocks_for(s.num_tokens + steps) - len(s.blocks)) for s in self.running]
            if sum(need) <= alloc.num_free or len(self.running) == 1:
                break
            victim = self.running.pop()
            self._requeue([victim])
            self.stats["preempted"] += 1
        if sum(need) > alloc.num_free:  # one sequence longer than the whole cache: it ends here
            (s,) = self.running
            log.warning(
                "request %r: %d tokens fill the KV cache (%d blocks of %d); its completion ends with stop "
                "reason 'length'. Raise native.mem_fraction_static or lower gconfig.max_new_tokens",
                s.request.rid, s.num_tokens, alloc.capacity, self.cache.block_size,
            )  # fmt: skip
            s.done = "length"
            return
        for s, n in zip(self.running, need):
            if n:
                s.blocks += alloc.allocate(n)

    def abort_all(self) -> list[Sequence]:
        """Every queued and running sequence, marked `abort` and out of the cache (tokens kept); the
        window in flight is read first (its finished completions wait in `drain()`)."""
        self.requeue_running()
        pending = [s for g in self.waiting for s in g.seqs]
        self.waiting.clear()
        for s in pending:
            s.done = "abort"
        return pending

    def requeue_running(self) -> None:
        """Every running sequence leaves the cache, keeping its tokens (weights changed, or sleep);
        the window in flight is read first."""
        self._settle()
        running, self.running = self.running, []
        self._requeue(running)

    def _requeue(self, seqs: list[Sequence]) -> None:
        for s in reversed(seqs):
            self.cache.allocator.free(s.blocks)
            s.blocks = []
            self.waiting.appendleft(_Group([s]))

    def _launch_window(self, finished: list[Sequence]) -> _Window | None:
        """A window for every running sequence from the host's state (it may preempt for blocks);
        None when none is left to run."""
        t0 = time.perf_counter()
        steps = max(1, min(self.decode_steps, max(self._remaining(s) for s in self.running)))
        self._ensure_blocks(steps)
        if any(s.done for s in self.running):
            self._retire(finished)
            return None
        seqs = list(self.running)
        last = torch.tensor([s.output[-1] for s in seqs])
        positions = torch.tensor([s.num_tokens - 1 for s in seqs])
        generated = torch.tensor([len(s.output) for s in seqs])
        return self._launch(seqs, last, positions, generated, steps, t0)

    def _remaining(self, s: Sequence) -> int:
        """Tokens `s` may still produce (its `max_new_tokens`, the engine's context)."""
        return min(s.params.max_new_tokens - len(s.output), self.model.max_model_len - s.num_tokens)

    def _chain(self, window: _Window) -> _Window | None:
        """The next window, launched before `window` is read: its rows are the running sequences
        that can still decode after `window`, fed `window`'s last tokens on the device. None when
        a queued sequence could join instead, or the blocks for it are not free."""
        t0 = time.perf_counter()
        ahead = window.steps
        index = {id(s): i for i, s in enumerate(window.seqs)}
        rows: list[Sequence] = []
        left: list[int] = []
        for s in self.running:  # a subset of window.seqs, in its order
            rem = self._remaining(s) - ahead
            if rem > 0:
                rows.append(s)
                left.append(rem)
        if not rows or (self.waiting and len(rows) < self.max_concurrent):
            return None
        steps = max(1, min(self.decode_steps, max(left)))
        alloc = self.cache.allocator
        need = [
            max(0, self.cache.blocks_for(s.num_tokens + ahead + min(steps, n)) - len(s.blocks))
            for s, n in zip(rows, left)
        ]
        if sum(need) > alloc.num_free:
            return None
        for s, n in zip(rows, need):
            if n:
                s.blocks += alloc.allocate(n)
        at = [index[id(s)] for s in rows]
        last = window.tokens[ahead - 1]
        if len(at) < len(window.seqs):  # the index goes up without waiting for the window in flight
            last = last[torch.tensor(at).to(last.device, non_blocking=True)]
        positions = torch.tensor([s.num_tokens - 1 + ahead for s in rows])
        generated = torch.tensor([len(s.output) + ahead for s in rows])
        self.stats["chained"] += 1
        return self._launch(rows, last, positions, generated, steps, t0)

    def _launch(self, seqs, last, positions, generated, steps: int, t0: float) -> _Window:
        """Queue a window's device work and the copy of its tokens to the host."""
        if self.oom_hook is not None:
            self.oom_hook("decode", len(seqs))
        max_blocks = self.cache.blocks_for(self.model.max_model_len)
        rows = np.zeros((len(seqs), max_blocks), dtype=np.int32)
        for i, s in enumerate(seqs):
            rows[i, : len(s.blocks)] = s.blocks[:max_blocks]
        table = torch.from_numpy(rows)
        st = build_sampling_tensors([(s.params, s.stop_ids) for s in seqs], torch.device("cpu"))
        self.send("decode", (table, last, positions, generated, st, steps))
        t1 = time.perf_counter()
        tokens, logprobs = self.run_decode(table, last, positions, generated, st, steps)
        window = _Window(seqs, steps, tokens, logprobs)
        if tokens.is_cuda:
            window.host = (
                torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True).copy_(
                    tokens, non_blocking=True
                ),
                torch.empty(logprobs.shape, dtype=logprobs.dtype, pin_memory=True).copy_(
                    logprobs, non_blocking=True
                ),
            )
            window.event = torch.cuda.Event()
            window.event.record()
        self.stats["decode_steps"] += steps
        self.stats["decode_launch_s"] += time.perf_counter() - t1
        self.stats["host_s"] += t1 - t0
        return window

    def _read_window(self, window: _Window, finished: list[Sequence]) -> None:
        """Wait for `window`'s tokens, append them to the rows still decoding, check stops."""
        t0 = time.perf_counter()
        if window.event is not None:
            assert window.host is not None
            window.event.synchronize()
            tokens, logprobs = window.host
        else:
            tokens, logprobs = window.tokens, window.logprobs
        # the window's one host read, a list per row
        tokens_h, logprobs_h = tokens.t().tolist(), logprobs.t().tolist()
        t1 = time.perf_counter()
        for s, row, lps in zip(window.seqs, tokens_h, logprobs_h):
            if s.done is not None:
                continue
            if s.params.stop or not s.stop_ids.isdisjoint(row):
                for t, lp in zip(row, lps):  # token by token: a stop may end the row inside the window
                    self._append(s, t, lp)
                    if s.done is not None:
                        break
                continue
            # no stop in the window: the row ends only at its length limit
            take = min(len(row), self._remaining(s))
            s.output += row[:take]
            s.logprobs += lps[:take]
            s.versions += [self.version] * take
            if self._remaining(s) <= 0:
                s.done = "length"
        self._retire(finished)
        self.stats["decode_wait_s"] += t1 - t0
        self.stats["host_s"] += time.perf_counter() - t1

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

    # ----------------------------------------------------------------- out of memory

    def _recover_from_oom(self, error: BaseException, admitted: list[_Group]) -> None:
        """Free the window's sequences, lower concurrency, re-queue them (their tokens kept).

        Affected: the running sequences and those admitted in this window (a failed prefill had not
        made them running yet); sequences that finished before the error are returned as usual."""
        affected = list(self.running)
        seen = {id(s) for s in affected}
        affected += [s for g in admitted for s in g.seqs if id(s) not in seen and s.done is None]
        self.running = []
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        fresh_groups = [g for g in admitted if g.fresh and g.seqs[0] in affected]
        if len(affected) <= 1 and self.max_concurrent <= 1:
            self._requeue(affected)
            raise GenerationOOMError(
                "out of GPU memory in generation with one sequence in flight "
                f"({affected[0].num_tokens if affected else 0} tokens). {self.oom_advice(1)}"
            ) from error
        new_limit = max(1, min(self.max_concurrent, len(affected)) // 2)
        log.warning(
            "out of GPU memory in generation with %d sequences in flight: lowered the concurrency from %d to %d "
            "and re-queued them (nothing is lost). %s",
            len(affected), self.max_concurrent, new_limit, self.oom_advice(len(affected)),
        )  # fmt: skip
        self.max_concurrent = new_limit
        self.stats["oom_retries"] += 1
        fresh = {id(s) for g in fresh_groups for s in g.seqs}
        self._requeue([s for s in affected if id(s) not in fresh])
        for g in reversed(fresh_groups):  # never prefilled: back as one group, prompt shared again
            for s in g.seqs:
                self.cache.allocator.free(s.blocks)
                s.blocks = []
            if len(g.seqs) > new_limit:  # too many at once now: one sequence per group
                for s in reversed(g.seqs):
                    self.waiting.appendleft(_Group([s]))
            else:
                self.waiting.appendleft(g)

    def oom_advice(self, in_flight: int) -> str:
        fraction = getattr(self, "mem_fraction_static", None)
        lower = (
            f"native.mem_fraction_static={max(0.1, fraction - 0.1):.2f} (now {fraction:.2f})"
            if fraction
            else ("a lower native.mem_fraction_static")
        )
        return (
            f"Fixes: rollout.max_concurrent_rollouts={max(1, in_flight // 2)} (now {self.max_concurrent}); "
            f"more tensor parallel (rollout.backend: native:d1t2); {lower}; or shorter "
            "gconfig.max_new_tokens"
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
