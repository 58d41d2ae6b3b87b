"""The native engine's scheduler: the queue, admission, KV block bookkeeping, preemption and the
out-of-memory fallback; host state only (the device work is `runner.Runner`'s).

Admission takes queued groups in order while a place (`max_concurrent` in flight), the blocks for
their prefill plus one decode window, and the prefill token budget (`max_prefill_tokens`) allow;
the completions of one request share the prompt's full blocks. When a window needs more blocks
than are free, the newest running sequences are preempted: they leave the cache (keeping their
tokens) and go back to the head of the queue, to be prefilled again. On an out-of-memory error
the sequences of the failed window are re-queued the same way and `max_concurrent` is halved; at
one sequence `GenerationOOMError` names the knobs to change.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import numpy as np
import torch

from laden.rollout.base import GenerationRequest
from laden.rollout.native.kv_cache import KVCache
from laden.rollout.native.sequence import Group, Sequence

log = logging.getLogger(__name__)


class GenerationOOMError(RuntimeError):
    """Out of GPU memory in generation with one sequence in flight: nothing left to lower."""


class Scheduler:
    """See the module docstring. `cache` is the KV cache whose blocks it hands out."""

    def __init__(
        self,
        cache: KVCache,
        *,
        max_model_len: int,
        max_concurrent: int,
        decode_steps: int,
        max_prefill_tokens: int,
        eos_token_ids: tuple[int, ...] = (),
        tokenizer: Any = None,
        mem_fraction_static: float | None = None,
    ) -> None:
        self.cache = cache
        self.max_model_len = max_model_len
        self.max_concurrent = max_concurrent
        self.concurrency_limit = max_concurrent  # as configured (an OOM lowers `max_concurrent` only)
        self.decode_steps = decode_steps
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids = tuple(eos_token_ids)
        self.tokenizer = tokenizer
        self.mem_fraction_static = mem_fraction_static  # named in the out-of-memory advice
        self.waiting: deque[Group] = deque()
        self.running: list[Sequence] = []

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
        if len(request.input_ids) >= self.max_model_len:
            raise ValueError(
                f"request {request.rid!r}: the prompt has {len(request.input_ids)} tokens, the engine's context "
                f"is {self.max_model_len} (max_model_len); shorten the prompt or raise max_model_len"
            )

    def add(self, request: GenerationRequest) -> None:
        """Queue `request` (its `n_samples` completions as one group: the prompt is prefilled once)."""
        self.check(request)
        params = request.sampling
        stop = frozenset() if params.ignore_eos else frozenset((*self.eos_token_ids, *params.stop_token_ids))
        seqs = [Sequence(request=request, sample_index=i, stop_ids=stop) for i in range(request.n_samples)]
        self.waiting.append(Group(seqs))

    @property
    def num_pending(self) -> int:
        return sum(len(g.seqs) for g in self.waiting) + len(self.running)

    def remaining(self, s: Sequence) -> int:
        """Tokens `s` may still produce (its `max_new_tokens`, the engine's context)."""
        return s.remaining(self.max_model_len)

    def staying(self, steps: int) -> int:
        """Running sequences that still decode after `steps` more (the others end at their length limit)."""
        return sum(1 for s in self.running if self.remaining(s) > steps)

    def abort_waiting(self) -> list[Sequence]:
        """Every queued sequence, marked `abort` and out of the queue."""
        pending = [s for g in self.waiting for s in g.seqs]
        self.waiting.clear()
        for s in pending:
            s.done = "abort"
        return pending

    # ----------------------------------------------------------------- admission

    def admit(self, in_flight: int | None = None) -> list[Group]:
        """Queued groups to prefill now, in order, while places (`in_flight` of `max_concurrent`
        taken: the running sequences unless given), blocks and the prefill token budget allow."""
        admitted: list[Group] = []
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

    def _reserve(self, group: Group) -> bool:
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

    # ----------------------------------------------------------------- blocks

    def slots(self, blocks: list[int], n: int) -> np.ndarray:
        """The cache slots of a sequence's first `n` tokens (int64)."""
        bs = self.cache.block_size
        pages = np.asarray(blocks[: -(-n // bs)], dtype=np.int64)
        return (pages[:, None] * bs + np.arange(bs)).reshape(-1)[:n]

    def partial_block_copies(self, rows: list[list[Sequence]]) -> list[tuple[int, int]]:
        """(source, destination) blocks: completions that share a prompt copy its partial last block."""
        bs = self.cache.block_size
        copies = []
        for seqs in rows:
            lead = seqs[0]
            if len(seqs) > 1 and lead.num_tokens % bs:
                partial = lead.num_tokens // bs
                copies += [(lead.blocks[partial], s.blocks[partial]) for s in seqs[1:]]
        return copies

    def block_table(self, seqs: list[Sequence]) -> torch.Tensor:
        """`[B, blocks of max_model_len]` int32: each row's blocks, zero-padded (the KV sink block)."""
        max_blocks = self.cache.blocks_for(self.max_model_len)
        rows = np.zeros((len(seqs), max_blocks), dtype=np.int32)
        for i, s in enumerate(seqs):
            rows[i, : len(s.blocks)] = s.blocks[:max_blocks]
        return torch.from_numpy(rows)

    def ensure_blocks(self, steps: int) -> int:
        """Every running sequence gets blocks for `steps` more tokens; the newest ones are preempted
        (back to the head of the queue, to be prefilled again) while blocks are short. How many were."""
        alloc = self.cache.allocator
        preempted = 0
        while True:
            need = [max(0, self.cache.blocks_for(s.num_tokens + steps) - len(s.blocks)) for s in self.running]
            if sum(need) <= alloc.num_free or len(self.running) == 1:
                break
            victim = self.running.pop()
            self.requeue([victim])
            preempted += 1
        if sum(need) > alloc.num_free:  # one sequence longer than the whole cache: it ends here
            (s,) = self.running
            log.warning(
                "request %r: %d tokens fill the KV cache (%d blocks of %d); its completion ends with stop "
                "reason 'length'. Raise native.mem_fraction_static or lower gconfig.max_new_tokens",
                s.request.rid, s.num_tokens, alloc.capacity, self.cache.block_size,
            )  # fmt: skip
            s.done = "length"
            return preempted
        for s, n in zip(self.running, need):
            if n:
                s.blocks += alloc.allocate(n)
        return preempted

    def reserve_ahead(self, rows: list[Sequence], ahead: int, tokens: list[int]) -> bool:
        """Blocks for `tokens[i]` more tokens of `rows[i]` after `ahead` not yet read (a chained
        window); False, allocating nothing, when they are not free (a chained window never preempts)."""
        alloc = self.cache.allocator
        need = [
            max(0, self.cache.blocks_for(s.num_tokens + ahead + n) - len(s.blocks))
            for s, n in zip(rows, tokens)
        ]
        if sum(need) > alloc.num_free:
            return False
        for s, n in zip(rows, need):
            if n:
                s.blocks += alloc.allocate(n)
        return True

    def retire(self, finished: list[Sequence]) -> None:
        """Finished running sequences give their blocks back and move to `finished`."""
        keep = []
        for s in self.running:
            if s.done is None:
                keep.append(s)
            else:
                self.cache.allocator.free(s.blocks)
                s.blocks = []
                finished.append(s)
        self.running = keep

    def requeue(self, seqs: list[Sequence]) -> None:
        """`seqs` leave the cache (tokens kept) for the head of the queue, in order."""
        for s in reversed(seqs):
            self.cache.allocator.free(s.blocks)
            s.blocks = []
            self.waiting.appendleft(Group([s]))

    def requeue_running(self) -> None:
        """Every running sequence leaves the cache for the head of the queue, keeping its tokens."""
        running, self.running = self.running, []
        self.requeue(running)

    # ----------------------------------------------------------------- failures

    def strand(self, admitted: list[Group]) -> None:
        """After a failed window: its sequences give their blocks back and are put back at the head of
        the queue (their tokens kept), so the engine stays consistent for an abort or a retry."""
        seen = {id(s) for s in self.running}
        stranded = list(self.running) + [
            s for g in admitted for s in g.seqs if id(s) not in seen and s.blocks
        ]
        self.running = []
        self.requeue([s for s in stranded if s.done is None])

    def recover_from_oom(self, error: BaseException, admitted: list[Group]) -> None:
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
            self.requeue(affected)
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
        fresh = {id(s) for g in fresh_groups for s in g.seqs}
        self.requeue([s for s in affected if id(s) not in fresh])
        for g in reversed(fresh_groups):  # never prefilled: back as one group, prompt shared again
            for s in g.seqs:
                self.cache.allocator.free(s.blocks)
                s.blocks = []
            if len(g.seqs) > new_limit:  # too many at once now: one sequence per group
                for s in reversed(g.seqs):
                    self.waiting.appendleft(Group([s]))
            else:
                self.waiting.appendleft(g)

    def oom_advice(self, in_flight: int) -> str:
        """The settings that make room, for an out-of-memory message."""
        fraction = self.mem_fraction_static
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
