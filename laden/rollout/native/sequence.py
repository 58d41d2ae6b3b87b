"""The native engine's units of work: a completion being generated (`Sequence`), a queued group of
them (`Group`) and a decode window on the device (`Window`).

A `Sequence` is one completion of a request: its tokens so far, its KV blocks and why it stopped.
Its cache holds every token but its last output token, which the next decode step feeds; a
sequence that left the cache keeps its tokens and is prefilled again from position 0."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from laden.rollout.base import GenerationRequest, GenerationResult, SamplingParams, StopReason


@dataclass(slots=True, eq=False)
class Sequence:
    """One completion (`sample_index` of `request`): output tokens with their log-probs and weight
    versions, the KV blocks it holds, and its stop reason once done."""

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

    def remaining(self, max_model_len: int) -> int:
        """Tokens it may still produce (its `max_new_tokens`, the engine's context)."""
        return min(self.params.max_new_tokens - len(self.output), max_model_len - self.num_tokens)

    def append(self, token: int, logprob: float, version: int, max_model_len: int, tokenizer: Any) -> None:
        """Add one sampled token and set `done` where it stops the completion."""
        self.output.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        n = len(self.output)
        params = self.params
        if (
            token in self.stop_ids
            and n >= params.min_new_tokens
            or (
                params.stop
                and not params.ignore_eos
                and n >= params.min_new_tokens
                and self._stop_string(tokenizer)
            )
        ):
            self.done = "stop"
        elif n >= params.max_new_tokens or self.num_tokens >= max_model_len:
            self.done = "length"

    def _stop_string(self, tokenizer: Any) -> bool:
        """Whether the text of the output ends a stop string at its last token (decoded tail only)."""
        longest = max(len(x) for x in self.params.stop)
        tail = tokenizer.decode(self.output[-(longest + 8) :])
        before = tokenizer.decode(self.output[-(longest + 8) : -1])
        return any(x in tail and x not in before for x in self.params.stop)

    def result(self) -> GenerationResult:
        assert self.done is not None
        return GenerationResult(
            rid=self.request.rid, sample_index=self.sample_index, input_ids=self.prompt,
            output_ids=list(self.output), output_logprobs=list(self.logprobs),
            output_versions=list(self.versions), stop_reason=self.done,
        )  # fmt: skip


@dataclass(slots=True, eq=False)
class Group:
    """Queued work: the fresh completions of one request (prefilled together) or one re-queued sequence."""

    seqs: list[Sequence]

    @property
    def fresh(self) -> bool:
        return not self.seqs[0].output

    def prefill_tokens(self) -> int:
        return self.seqs[0].num_tokens if self.fresh else sum(s.num_tokens for s in self.seqs)


@dataclass(slots=True, eq=False)
class Window:
    """A decode window launched on the device and not yet read by the host."""

    seqs: list[Sequence]  # its rows, in order (the running set when it was launched)
    steps: int
    tokens: torch.Tensor  # [steps, rows] on the device
    logprobs: torch.Tensor
    host: tuple[torch.Tensor, torch.Tensor] | None = None  # pinned copies being filled (CUDA)
    event: Any = None  # recorded after the copies (CUDA)
