"""The native engine's synchronous core: the loop of windows, composed of a `Scheduler` (queue,
admission, KV blocks, preemption, out of memory) and a `Runner` (the model and sampling on the device).

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

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from laden.rollout.base import GenerationRequest, GenerationResult
from laden.rollout.native.runner import Runner
from laden.rollout.native.sampler import build_sampling_tensors
from laden.rollout.native.scheduler import GenerationOOMError, Scheduler
from laden.rollout.native.sequence import Group, Sequence, Window
from laden.rollout.native.tensor_parallel import Message


class GenerationCore:
    """See the module docstring: `scheduler` decides what runs, `runner` runs it on the device."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: Runner,
        *,
        oom_hook: Callable[[str, int], None] | None = None,
        chain_windows: bool = False,
    ) -> None:
        self.scheduler, self.runner = scheduler, runner
        self.cache = scheduler.cache
        self.tp = runner.tp
        self._unsent: list[GenerationResult] = []  # tensor parallel leader: results for the next message
        self.version = 0
        self.oom_hook = oom_hook  # tests: called as (phase, batch size) before each device phase
        self.chain_windows = chain_windows and runner.tp is None
        self.may_chain: Callable[[], bool] | None = None  # the engine: False while someone waits for it
        self._inflight: Window | None = None
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

    # ----------------------------------------------------------------- the engine's view

    def check(self, request: GenerationRequest) -> None:
        """Raise `ValueError` (naming the request and the fix) for a request this engine cannot run."""
        self.scheduler.check(request)

    def add(self, request: GenerationRequest) -> None:
        """Queue `request` (its `n_samples` completions as one group: the prompt is prefilled once)."""
        self.scheduler.add(request)

    @property
    def idle(self) -> bool:
        return not self.scheduler.waiting and not self.scheduler.running and not self._ready

    @property
    def max_concurrent(self) -> int:
        """Sequences in flight at most now (halved by each out-of-memory error)."""
        return self.scheduler.max_concurrent

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The token ids that end a completion (unless a request ignores them)."""
        return self.scheduler.eos_token_ids

    @property
    def generator(self) -> torch.Generator:
        """The torch sampler's random generator."""
        return self.runner.generator

    # ----------------------------------------------------------------- one window

    def step(self) -> list[GenerationResult]:
        """Admit, prefill, decode one window; the completions that finished in it.

        With a window in flight (chained windows) it launches the next one first when it may,
        then reads the one in flight. When queued sequences can join, the window just launched is
        left in flight instead, and the next step builds and queues their prefill behind it before
        reading it (the GPU does not wait for the host's prefill work), then launches a window for
        every running sequence."""
        sched = self.scheduler
        finished: list[Sequence] = []
        admitted: list[Group] = []
        try:
            if self._inflight is None:
                admitted = sched.admit()
                if admitted:
                    self._timed_prefill(admitted, finished)
                if sched.running:
                    self._inflight = self._launch_window(finished)
                if self._inflight is not None and not self._joinable(self._inflight):
                    self._advance(finished)
            elif self._joinable(self._inflight):
                admitted = sched.admit(sched.staying(self._inflight.steps))

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
                if sched.running:
                    self._inflight = self._launch_window(finished)
            else:
                self._advance(finished)
        except torch.OutOfMemoryError as e:
            if self.tp is None:
                self._settle()  # a window in flight is read first: its tokens are kept
                sched.recover_from_oom(e, admitted)
                self.stats["oom_retries"] += 1
            else:
                sched.strand(admitted)
                raise GenerationOOMError(
                    f"out of GPU memory in a tensor parallel window (not recovered: every rank takes part in "
                    f"each layer). {sched.oom_advice(sched.num_pending)}"
                ) from e
        except BaseException:
            self._inflight = None  # its tokens are dropped; the sequences keep the ones read before
            sched.strand(admitted)
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

    def abort_all(self) -> list[Sequence]:
        """Every queued and running sequence, marked `abort` and out of the cache (tokens kept); the
        window in flight is read first (its finished completions wait in `drain()`)."""
        self.requeue_running()
        return self.scheduler.abort_waiting()

    def requeue_running(self) -> None:
        """Every running sequence leaves the cache, keeping its tokens (weights changed, or sleep);
        the window in flight is read first."""
        self._settle()
        self.scheduler.requeue_running()

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

    def _joinable(self, window: Window) -> bool:
        """Whether queued sequences may join while `window` is in flight: a free place after it and
        chaining allowed."""
        sched = self.scheduler
        return (
            bool(sched.waiting) and self._may_chain() and sched.staying(window.steps) < sched.max_concurrent
        )

    def _advance(self, finished: list[Sequence]) -> None:
        """Launch the next window from the one in flight when it may (`_chain`), then read that one."""
        assert self._inflight is not None
        nxt = self._chain(self._inflight) if self._may_chain() else None
        window, self._inflight = self._inflight, nxt
        self._read_window(window, finished)

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
        self.runner.follow(message)
        if message.kind == "decode":
            self.stats["windows"] += 1

    # ----------------------------------------------------------------- prefill

    def _timed_prefill(self, groups: list[Group], finished: list[Sequence], then=None) -> None:
        t0 = time.perf_counter()
        self._prefill(groups, finished, then)
        self.stats["prefill_s"] += time.perf_counter() - t0

    def _prefill(
        self, groups: list[Group], finished: list[Sequence], then: Callable[[], None] | None = None
    ) -> None:
        """Prefill `groups` and sample each completion's first token; `then` runs once the device
        work is queued, before the host waits for the sampled tokens."""
        sched = self.scheduler
        ids: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        bounds = [0]
        rows: list[list[Sequence]] = []  # the sequences that sample from each prefilled row
        for g in groups:
            lead = g.seqs[0]
            for s in [lead] if g.fresh else g.seqs:
                n = s.num_tokens
                ids += [np.asarray(s.prompt, dtype=np.int64), np.asarray(s.output, dtype=np.int64)]
                slots.append(sched.slots(s.blocks, n))
                bounds.append(bounds[-1] + n)
                rows.append(g.seqs if g.fresh else [s])
        positions = np.concatenate([np.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])])
        # in numpy: a Python loop per token took milliseconds a prefill
        ids_np, slots_np = np.concatenate(ids), np.concatenate(slots)
        if self.oom_hook is not None:
            self.oom_hook("prefill", len(bounds) - 1)
        dev = self.runner.device
        copies = sched.partial_block_copies(rows)
        self.send("prefill", (ids_np, positions, slots_np, bounds, copies))
        logits = self.runner.run_prefill(ids_np, positions, slots_np, bounds, copies)
        assert logits is not None
        self.stats["prefill_tokens"] += bounds[-1]
        expanded = [r for r, seqs in enumerate(rows) for _ in seqs]  # completions of a prompt share its row
        flat = [s for seqs in rows for s in seqs]
        st = build_sampling_tensors([(s.params, s.stop_ids) for s in flat], dev)
        generated = torch.tensor([len(s.output) for s in flat], device=dev)
        row_logits = logits[torch.tensor(expanded, device=dev)]
        sampled, sampled_lp = self.runner.sample(row_logits, st, generated)
        if then is not None:
            then()
        tokens_h, logprobs_h = sampled.tolist(), sampled_lp.tolist()
        for s, t, lp in zip(flat, tokens_h, logprobs_h):
            sched.running.append(s)
            s.append(t, lp, self.version, sched.max_model_len, sched.tokenizer)
        sched.retire(finished)

    # ----------------------------------------------------------------- decode windows

    def _launch_window(self, finished: list[Sequence]) -> Window | None:
        """A window for every running sequence from the host's state (it may preempt for blocks);
        None when none is left to run."""
        sched = self.scheduler
        t0 = time.perf_counter()
        steps = max(1, min(sched.decode_steps, max(sched.remaining(s) for s in sched.running)))
        self.stats["preempted"] += sched.ensure_blocks(steps)
        if any(s.done for s in sched.running):
            sched.retire(finished)
            return None
        seqs = list(sched.running)
        last = torch.tensor([s.output[-1] for s in seqs])
        positions = torch.tensor([s.num_tokens - 1 for s in seqs])
        generated = torch.tensor([len(s.output) for s in seqs])
        return self._launch(seqs, last, positions, generated, steps, t0)

    def _chain(self, window: Window) -> Window | None:
        """The next window, launched before `window` is read: its rows are the running sequences
        that can still decode after `window`, fed `window`'s last tokens on the device. None when
        a queued sequence could join instead, or the blocks for it are not free."""
        sched = self.scheduler
        t0 = time.perf_counter()
        ahead = window.steps
        index = {id(s): i for i, s in enumerate(window.seqs)}
        rows: list[Sequence] = []
        left: list[int] = []
        for s in sched.running:  # a subset of window.seqs, in its order
            rem = sched.remaining(s) - ahead
            if rem > 0:
                rows.append(s)
                left.append(rem)
        if not rows or (sched.waiting and len(rows) < sched.max_concurrent):
            return None
        steps = max(1, min(sched.decode_steps, max(left)))
        if not sched.reserve_ahead(rows, ahead, [min(steps, n) for n in left]):
            return None
        at = [index[id(s)] for s in rows]
        last = window.tokens[ahead - 1]
        if len(at) < len(window.seqs):  # the index goes up without waiting for the window in flight
            last = last[torch.tensor(at).to(last.device, non_blocking=True)]
        positions = torch.tensor([s.num_tokens - 1 + ahead for s in rows])
        generated = torch.tensor([len(s.output) + ahead for s in rows])
        self.stats["chained"] += 1
        return self._launch(rows, last, positions, generated, steps, t0)

    def _launch(self, seqs, last, positions, generated, steps: int, t0: float) -> Window:
        """Queue a window's device work and the copy of its tokens to the host."""
        if self.oom_hook is not None:
            self.oom_hook("decode", len(seqs))
        table = self.scheduler.block_table(seqs)
        st = build_sampling_tensors([(s.params, s.stop_ids) for s in seqs], torch.device("cpu"))
        self.send("decode", (table, last, positions, generated, st, steps))
        t1 = time.perf_counter()
        tokens, logprobs = self.runner.run_decode(table, last, positions, generated, st, steps)
        window = Window(seqs, steps, tokens, logprobs)
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

    def _read_window(self, window: Window, finished: list[Sequence]) -> None:
        """Wait for `window`'s tokens, append them to the rows still decoding, check stops."""
        sched = self.scheduler
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
                    s.append(t, lp, self.version, sched.max_model_len, sched.tokenizer)
                    if s.done is not None:
                        break
                continue
            # no stop in the window: the row ends only at its length limit
            take = min(len(row), sched.remaining(s))
            s.output += row[:take]
            s.logprobs += lps[:take]
            s.versions += [self.version] * take
            if sched.remaining(s) <= 0:
                s.done = "length"
        sched.retire(finished)
        self.stats["decode_wait_s"] += t1 - t0
        self.stats["host_s"] += time.perf_counter() - t1
