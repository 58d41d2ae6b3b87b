"""The rollout-engine seam: what every generation backend (`rollout.backend`) does.

A rollout engine turns prompts (token ids) into completions, one token at a time, under the
policy's current weights, and takes new weights from the trainer between (or in the middle
of) generations. Every backend implements `RolloutEngine`: the embedded `native` engine
(`laden.rollout.native`) and the vLLM and SGLang servers laden starts and drives over HTTP
(`laden.rollout.servers`), so the RL trainer is written once against this protocol.

- `generate(requests)` is an async iterator: each request's completions come back as they
  finish (not in request order), every one exactly once. A request with `n_samples > 1`
  yields that many results (`sample_index` 0..n-1), whose prompt an engine may prefill once.
- Each result carries, per generated token, its log-probability under the sampling
  distribution `softmax(logits / temperature)` (before top-k / top-p truncation: the number
  the trainer's teacher-forced `TrainEngine.forward(..., temperature=)` reproduces) and the
  weight `version` that produced it.
- `pause()` stops decoding at a token boundary (requests in flight stay in flight); between
  `pause()` and `resume()` the weights may be swapped with `update_weights(source, version)`;
  after `resume()` the same requests continue under the new weights, so one completion can
  hold tokens of several versions (what `max_head_offpolicyness` bounds).
- `sleep()` releases the accelerator memory the engine holds (the KV cache; its weights too
  when `sleep(weights=True)`: the trainer holds them, colocated) and `wake()` restores it, so a
  colocated trainer gets the GPU back while it trains.

A weight `source` is one of `laden.weights`' descriptions (`WeightUpdateMeta`): a versioned
directory on disk, a broadcast group (`xccl`, buckets of `weight_chunked_mem_mb`), or, when
the trainer runs in the same process, an iterable of `(hf_name, tensor)` pairs (an engine's
`named_weights(...)`), copied into the engine's weights in place.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from laden.config.schema import GenerationConfig

StopReason = Literal["stop", "length", "abort"]
"""`stop`: a stop token or stop string ended the completion; `length`: `max_new_tokens` (or the
engine's context length) was reached; `abort`: the engine was shut down before it finished."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How one request is sampled (the `gconfig.*` fields, per request)."""

    max_new_tokens: int = 256
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the completion (the stop token is kept in the output)."""
    stop: tuple[str, ...] = ()
    """Stop strings: the completion ends at the first token whose decoded text contains one
    (needs a tokenizer in the engine; the output keeps the tokens up to that one)."""
    ignore_eos: bool = False
    """Generate exactly `max_new_tokens` (stop tokens and strings are ignored): benchmarks."""

    def __post_init__(self) -> None:
        problems = []
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            problems.append(
                f"min_new_tokens={self.min_new_tokens} must be in [0, max_new_tokens={self.max_new_tokens}]"
            )
        if not self.greedy and not self.temperature > 0:
            problems.append(f"temperature={self.temperature} must be > 0 (or set greedy=True)")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p} must be in (0, 1] (1 = off)")
        if self.top_k < 0:
            problems.append(f"top_k={self.top_k} must be >= 0 (0 = off)")
        if problems:
            raise ValueError("invalid sampling settings: " + "; ".join(problems))

    @property
    def logprob_temperature(self) -> float:
        """The temperature the returned log-probabilities are taken at (1 when greedy)."""
        return 1.0 if self.greedy else self.temperature

    @classmethod
    def from_config(cls, gconfig: GenerationConfig, **overrides: Any) -> SamplingParams:
        """The settings `gconfig` describes (its `n_samples` goes on the request)."""
        params = cls(
            max_new_tokens=gconfig.max_new_tokens,
            min_new_tokens=gconfig.min_new_tokens,
            temperature=gconfig.temperature,
            top_p=gconfig.top_p,
            top_k=gconfig.top_k,
            greedy=gconfig.greedy,
            stop_token_ids=tuple(gconfig.stop_token_ids),
            stop=tuple(gconfig.stop),
            ignore_eos=gconfig.ignore_eos,
        )
        return replace(params, **overrides) if overrides else params


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationRequest:
    """One prompt to complete `n_samples` times."""

    rid: str
    """Caller's id, unique among the requests in flight; results carry it back."""
    input_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    n_samples: int = 1

    def __post_init__(self) -> None:
        if not self.input_ids:
            raise ValueError(
                f"request {self.rid!r} has an empty prompt (input_ids=()); give at least one token"
            )
        if self.n_samples < 1:
            raise ValueError(f"request {self.rid!r}: n_samples={self.n_samples} must be >= 1")


@dataclass(slots=True, kw_only=True)
class GenerationResult:
    """One completion of one request."""

    rid: str
    sample_index: int
    input_ids: tuple[int, ...]
    output_ids: list[int]
    output_logprobs: list[float]
    """log p(token) under softmax(logits / temperature), per output token."""
    output_versions: list[int]
    """The weight version that produced each output token."""
    stop_reason: StopReason

    def __post_init__(self) -> None:
        n = len(self.output_ids)
        if len(self.output_logprobs) != n or len(self.output_versions) != n:
            raise ValueError(
                f"result {self.rid!r}/{self.sample_index}: {n} tokens, {len(self.output_logprobs)} log-probs, "
                f"{len(self.output_versions)} versions; every output token needs one of each"
            )


@runtime_checkable
class RolloutEngine(Protocol):
    """A generation backend (see the module docstring)."""

    def generate(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[GenerationResult]:
        """Complete every request; results stream back as they finish, each exactly once."""
        ...

    async def pause(self) -> None:
        """Stop decoding at a token boundary; requests in flight wait for `resume()`."""
        ...

    async def resume(self) -> None:
        """Continue the paused requests (under the weights loaded since, if any)."""
        ...

    async def update_weights(self, source: Any, version: int) -> None:
        """Load new weights from `source` (a `laden.weights.WeightUpdateMeta`, or `(name, tensor)`
        pairs in process) and tag the tokens generated from now on with `version`."""
        ...

    async def sleep(self, *, weights: bool = False) -> None:
        """Release the KV cache (and the weights when `weights`): the trainer gets the memory."""
        ...

    async def wake(self) -> None:
        """Restore what `sleep` released (weights come back by `update_weights` if released)."""
        ...

    def sleep_frees_bytes(self) -> int | None:
        """The bytes `sleep` frees on the trainer's GPU (None: none, or unknown)."""
        ...

    def sampling_state(self) -> dict[str, Any] | None:
        """The state its random draws continue from (for a checkpoint), or None when it cannot be saved
        (servers sample with their own seeds)."""
        ...

    def load_sampling_state(self, state: dict[str, Any]) -> None:
        """Continue from `sampling_state()`'s result: the same draws follow as after it was taken."""
        ...

    @property
    def version(self) -> int:
        """The version of the weights the engine generates with now."""
        ...

    async def close(self) -> None:
        """End generation and free everything (server processes end too); idempotent."""
        ...
