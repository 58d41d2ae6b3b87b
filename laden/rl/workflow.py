"""Rollout workflows: how one data row becomes scored completions (`Trajectory`s) for the trainer.

A workflow (AReaL's `RolloutWorkflow`) owns everything between a data row and the trainer's
input: it renders the prompt, asks a `RolloutEngine` for completions, scores them, and returns
one `Trajectory` per completion, or None to reject the row. The trainer runs many episodes
concurrently on one event loop, so a workflow only awaits: it never blocks the loop.

- `RLVRWorkflow` (RL from verifiable rewards): one prompt, `n_samples` completions, one reward
  each. The prompt goes out as ONE request with `n_samples`, so the engine prefills it once for
  the whole group (the native engine shares its KV blocks). Each completion is scored as soon as
  it streams back, while the others are still decoding; scoring costs no extra wall time
  unless the reward is slower than generation.
- `MultiTurnWorkflow`: the model answers; a wrong answer (reward below 1) gets a user feedback
  turn and another try, up to `max_turns`. The conversation is kept as tokens and never
  re-rendered: the next turn's prompt is the last prompt, the model's own tokens, and the chat
  template's tokens for "end of answer, feedback turn, start of answer". So the trajectory's
  `prompt_ids` are exactly what the engine conditioned on. Re-rendering the conversation as
  text would re-tokenize the model's answer (possibly into other tokens) and let templates
  rewrite earlier turns, and then the trainer's log-probs would not match the behaviour ones.
  What this costs: a template that renders a turn differently depending on what comes after it
  gets the generic separator (the one rendered from a probe conversation) rather than its exact
  rendering of this conversation.

Prompts: a row's prompt is a list of chat turns (`messages`) or a string (`prompt`); turns go
through `tokenizer.apply_chat_template(..., add_generation_prompt=True)`, a string becomes one
user turn when the tokenizer has a chat template and is encoded as is (with the tokenizer's own
BOS) when it has none. The template is rendered to text, then encoded without adding special
tokens (the rendering has them), as `laden.data.sft` does for training data.

Rewards get `prompt` (the prompt as text), `completion` (decoded with
`skip_special_tokens=True`), `prompt_ids`, `completion_ids`, and every field of the row except
the prompt fields (`messages`, `prompt`, the `prompt_key`). A `RewardPool` scores in worker
processes (timeouts, crash isolation, `on_error`); a plain callable runs on the event loop (or in
a thread with `reward_in_thread=True`) and its exceptions reach the caller; an `async` callable
is awaited.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import math
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from laden.import_path import resolve_import_path
from laden.rl.reward_styles import RAW_PROMPT_KEY
from laden.rollout.base import GenerationRequest, GenerationResult, RolloutEngine, SamplingParams

PROMPT_KEYS = ("messages", "prompt")
"""Fields read as the prompt when `prompt_key` is None (the first present wins); never reward fields."""
_REWARD_ARGS = ("prompt", "completion", "prompt_ids", "completion_ids")


@dataclass(kw_only=True, slots=True)
class Trajectory:
    """One scored completion of one prompt: what the trainer turns into a training sequence."""

    prompt_ids: tuple[int, ...]
    """The tokens the engine conditioned on (multi-turn: the conversation before the last answer)."""
    completion_ids: list[int]
    """The generated tokens (the ones trained on)."""
    logprobs: list[float]
    """Behaviour log-probability of each completion token (`GenerationResult.output_logprobs`)."""
    versions: list[int]
    """The weight version that generated each completion token."""
    reward: float
    """The completion's scalar reward (multi-turn: discounted by `turn_discount` per extra turn)."""
    stop_reason: str
    """`stop`, `length` or `abort` (`laden.rollout.base.StopReason`)."""
    group_id: str
    """The prompt's id: the completions of one prompt share it (GRPO's group)."""
    sample_index: int
    """Which of the prompt's `n_samples` completions this is (0..n-1)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Extras for logging: the prompt and completion text, the row's data fields, per-turn rewards."""
    loss_mask: list[int] | None = None
    """Per completion token, 1 where the model generated it (trained on) and 0 where it did not (a tool output
    or user turn inside one concatenated conversation: `laden.rl.agent`); None: every token is the model's.
    Tokens with 0 carry log-prob 0 and version -1."""

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"trajectory {self.group_id!r}/{self.sample_index}: {n} completion tokens, "
                f"{len(self.logprobs)} log-probs, {len(self.versions)} versions; every token needs one of each"
            )
        if self.loss_mask is not None and len(self.loss_mask) != n:
            raise ValueError(
                f"trajectory {self.group_id!r}/{self.sample_index}: {n} completion tokens but a loss mask of "
                f"{len(self.loss_mask)}; give one 0/1 per completion token"
            )

    @property
    def has_eos(self) -> bool:
        """The completion ended on a stop token or string (not truncated, not aborted)."""
        return self.stop_reason == "stop"

    @property
    def min_version(self) -> int:
        """The oldest weight version among the model's tokens of the completion (-1 when it has none)."""
        return min(self.model_versions, default=-1)

    @property
    def model_versions(self) -> list[int]:
        """The versions of the tokens the model generated (those of the loss mask)."""
        if self.loss_mask is None:
            return list(self.versions)
        return [v for v, m in zip(self.versions, self.loss_mask) if m]


@runtime_checkable
class RolloutWorkflow(Protocol):
    """Turns one data row into trajectories with a rollout engine (see the module docstring)."""

    async def arun_episode(self, engine: RolloutEngine, data: dict[str, Any]) -> list[Trajectory] | None:
        """The row's trajectories, or None to reject the row (the trainer then draws another)."""
        ...


@runtime_checkable
class RewardScorer(Protocol):
    """An asynchronous scorer such as `laden.rl.reward_pool.RewardPool`."""

    async def score(self, **kwargs: Any) -> float: ...


Reward = RewardScorer | Callable[..., Any]
"""A `RewardPool` (or any `RewardScorer`), or `fn(prompt, completion, prompt_ids, completion_ids,
**fields) -> float` (sync or async)."""


# --- prompts -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Prompt:
    """A row's rendered prompt."""

    key: str
    """The field it came from."""
    text: str
    """What the model sees, as text (the chat template's rendering, or the raw string)."""
    ids: tuple[int, ...]


def render_prompt(
    data: Mapping[str, Any],
    tokenizer: Any,
    prompt_key: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> Prompt:
    """Render and tokenize a row's prompt (see the module docstring); `ValueError` says what is wrong."""
    key = prompt_key or next((k for k in PROMPT_KEYS if data.get(k) is not None), None)
    if key is None or data.get(key) is None:
        wanted = repr(prompt_key) if prompt_key else " or ".join(map(repr, PROMPT_KEYS))
        raise ValueError(
            f"the data row has no {wanted} field (its keys are {sorted(data)}); give each row a list of "
            "chat turns under 'messages' or a string under 'prompt', or set prompt_key to the column"
        )
    value = data[key]
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(value, str) and not template:
        ids = tokenizer(value, add_special_tokens=True)["input_ids"]  # its own BOS, as at inference
        return Prompt(key, value, tuple(ids))
    messages = [{"role": "user", "content": value}] if isinstance(value, str) else value
    if not _is_messages(messages):
        raise ValueError(
            f"prompt field {key!r} must be a string or a list of {{'role', 'content'}} dicts, got {value!r:.200}"
        )
    if not template:
        raise ValueError(
            f"prompt field {key!r} holds chat turns, but {_tokenizer_name(tokenizer)} has no chat template; "
            "set tokenizer.chat_template or give the prompt as a string"
        )
    text = tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=True, **dict(chat_template_kwargs or {})
    )
    return Prompt(key, text, tuple(_encode(tokenizer, text)))


def reward_fields(data: Mapping[str, Any], prompt_key: str) -> dict[str, Any]:
    """The row's fields a reward gets as keyword arguments: all but the prompt fields."""
    fields = {k: v for k, v in data.items() if k != prompt_key and k not in PROMPT_KEYS}
    clashes = [k for k in (*_REWARD_ARGS, RAW_PROMPT_KEY) if k in fields]
    if clashes:
        raise ValueError(
            f"data field(s) {clashes} clash with the reward's own arguments {_REWARD_ARGS}; rename them in the dataset"
        )
    return fields


def _is_messages(value: Any) -> bool:
    return isinstance(value, Sequence) and all(isinstance(m, Mapping) and "role" in m for m in value)


def _encode(tokenizer: Any, text: str) -> list[int]:
    # A rendered template already carries its special tokens (BOS included).
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _tokenizer_name(tokenizer: Any) -> str:
    return f"tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r}"


# --- generation and scoring ----------------------------------------------------------------------


class _RequestIds:
    """Request ids unique among every workflow's requests: a random prefix per workflow and a counter."""

    __slots__ = ("_prefix", "_count")

    def __init__(self) -> None:
        self._prefix = uuid.uuid4().hex[:12]
        self._count = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}-{next(self._count)}"


Scored = tuple[float, dict[str, Any]]
"""A completion's reward and what the trajectory's `info` keeps of its scoring: `reward_parts` (each
function's reward, by name) and `reward_error` (the failure's text, when the reward failed)."""


async def score_reward(reward: Reward, in_thread: bool, kwargs: dict[str, Any]) -> Scored:
    """One reward, awaited: through the pool's workers, in a thread, or on the loop."""
    if isinstance(reward, RewardScorer):
        outcome = getattr(reward, "score_outcome", None)
        if outcome is None:
            return float(await reward.score(**kwargs)), {}
        result = await outcome(**kwargs)
        info: dict[str, Any] = {"reward_parts": dict(result.parts)}
        if result.error is not None:
            info["reward_error"] = result.error
        return float(result.value), info
    kwargs.pop(RAW_PROMPT_KEY, None)
    value = await asyncio.to_thread(reward, **kwargs) if in_thread else reward(**kwargs)
    if inspect.isawaitable(value):
        value = await value
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"the reward function returned {value!r}; it must return a float") from None
    if not math.isfinite(number):
        raise ValueError(f"the reward function returned {number}; rewards must be finite")
    return number, {}


async def _generate_and_score(
    engine: RolloutEngine, request: GenerationRequest, score: Callable[[GenerationResult], Awaitable[Scored]]
) -> list[tuple[GenerationResult, Scored]]:
    """Every completion of `request` with its reward, by sample index; each is scored as it arrives."""
    pending: list[tuple[GenerationResult, asyncio.Future[Scored]]] = []
    try:
        async for result in engine.generate([request]):
            pending.append((result, asyncio.ensure_future(score(result))))
        rewards = await asyncio.gather(*(future for _, future in pending))
    finally:
        for _, future in pending:
            future.cancel()  # no-op for finished ones; stops stragglers when generation failed
    if len(pending) != request.n_samples:
        raise RuntimeError(
            f"the rollout engine returned {len(pending)} completions for request {request.rid!r} of "
            f"n_samples={request.n_samples}; every sample must come back exactly once"
        )
    scored = [(result, reward) for (result, _), reward in zip(pending, rewards)]
    return sorted(scored, key=lambda pair: pair[0].sample_index)


def _check_common(n_samples: int, reward: Any) -> list[str]:
    problems = []
    if not isinstance(n_samples, int) or n_samples < 1:
        problems.append(f"n_samples={n_samples!r} must be an integer >= 1")
    if not (isinstance(reward, RewardScorer) or callable(reward)):
        problems.append(
            f"reward={reward!r} must be a RewardPool or a function (prompt, completion, prompt_ids, "
            "completion_ids, **fields) -> float"
        )
    return problems


def _check_dynamic_sampling(dynamic_sampling: bool, n_samples: int) -> list[str]:
    if dynamic_sampling and n_samples == 1:
        return [
            "dynamic_sampling=True with n_samples=1 would reject every prompt (one reward is always "
            "'all equal'); use n_samples >= 2 or turn dynamic_sampling off"
        ]
    return []


def _raise_problems(name: str, problems: list[str]) -> None:
    if problems:
        raise ValueError(f"invalid {name} settings: " + "; ".join(problems))


# --- the workflows -------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class RLVRWorkflow:
    """One prompt, `n_samples` completions sharing its prefill, one reward each (see the module docstring)."""

    tokenizer: Any
    """A Hugging Face tokenizer: renders prompts and decodes completions for the reward."""
    sampling: SamplingParams
    """How every completion is sampled."""
    n_samples: int
    """Completions per prompt (GRPO's group size)."""
    reward: Reward
    """A `RewardPool`, or a function called with the reward arguments (module docstring)."""
    prompt_key: str | None = None
    """The row's prompt field; None: 'messages' if the row has it, else 'prompt'."""
    dynamic_sampling: bool = False
    """Reject a prompt (return None) whose rewards are all equal: its group carries no gradient."""
    reward_in_thread: bool = False
    """Run a plain reward function in a thread (slow but thread-safe rewards) instead of on the loop."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for `apply_chat_template` (e.g. `enable_thinking`)."""
    _ids: _RequestIds = field(default_factory=_RequestIds, init=False, repr=False)

    def __post_init__(self) -> None:
        problems = _check_common(self.n_samples, self.reward)
        problems += _check_dynamic_sampling(self.dynamic_sampling, self.n_samples)
        _raise_problems("RLVRWorkflow", problems)

    async def arun_episode(self, engine: RolloutEngine, data: dict[str, Any]) -> list[Trajectory] | None:
        """The prompt's `n_samples` trajectories by sample index; None when dynamic sampling rejects it."""
        prompt = render_prompt(data, self.tokenizer, self.prompt_key, self.chat_template_kwargs)
        fields = reward_fields(data, prompt.key)
        request = GenerationRequest(
            rid=self._ids.next(), input_ids=prompt.ids, sampling=self.sampling, n_samples=self.n_samples
        )
        completions: dict[int, str] = {}

        async def score(result: GenerationResult) -> Scored:
            text = completions[result.sample_index] = self._decode(result.output_ids)
            kwargs = dict(fields, prompt=prompt.text, completion=text)
            kwargs.update(prompt_ids=list(prompt.ids), completion_ids=list(result.output_ids))
            kwargs[RAW_PROMPT_KEY] = data[prompt.key]
            return await score_reward(self.reward, self.reward_in_thread, kwargs)

        scored = await _generate_and_score(engine, request, score)
        if self.dynamic_sampling and len({reward for _, (reward, _) in scored}) == 1:
            return None
        return [
            _trajectory(r, reward, request.rid, r.sample_index, prompt=prompt.text,
                        completion=completions[r.sample_index], data=dict(fields), **scoring)
            for r, (reward, scoring) in scored
        ]  # fmt: skip

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


@dataclass(kw_only=True, slots=True)
class MultiTurnWorkflow:
    """Answer, get feedback while wrong, answer again, up to `max_turns` (see the module docstring).

    Each of the `n_samples` conversations continues on its own; their first turns go out as one
    request (one prefill). The trajectory is the LAST answer: its `prompt_ids` are the whole
    conversation before it, its reward the last turn's reward times `turn_discount ** (turns - 1)`;
    `info["turn_rewards"]` keeps every turn's reward. A conversation ends early on a reward >= 1
    or an aborted completion, and before a turn whose prompt would not fit the engine's context
    (`max_model_len`, where the engine has one): then the last answer that fitted is the trajectory.
    """

    tokenizer: Any
    """A Hugging Face tokenizer: renders prompts and the feedback turn, decodes answers."""
    sampling: SamplingParams
    """How every answer is sampled."""
    n_samples: int = 1
    """Conversations per prompt (GRPO's group size)."""
    reward: Reward
    """A `RewardPool`, or a function called with the reward arguments (module docstring)."""
    max_turns: int = 2
    """Answers per conversation at most."""
    feedback: str = "Your answer is wrong. Try again."
    """The user turn that follows a wrong answer."""
    turn_discount: float = 1.0
    """The reward is multiplied by this once per turn after the first (1 = no discount)."""
    dynamic_sampling: bool = False
    """Reject a prompt (return None) whose final rewards are all equal, as `RLVRWorkflow` does."""
    prompt_key: str | None = None
    """The row's prompt field; None: 'messages' if the row has it, else 'prompt'."""
    reward_in_thread: bool = False
    """Run a plain reward function in a thread instead of on the loop."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for `apply_chat_template`."""
    _ids: _RequestIds = field(default_factory=_RequestIds, init=False, repr=False)
    _separator: tuple[int, ...] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        problems = _check_common(self.n_samples, self.reward)
        if not isinstance(self.max_turns, int) or self.max_turns < 1:
            problems.append(f"max_turns={self.max_turns!r} must be an integer >= 1")
        if not 0 <= self.turn_discount <= 1:
            problems.append(f"turn_discount={self.turn_discount!r} must be in [0, 1] (1 = no discount)")
        if not isinstance(self.feedback, str) or not self.feedback.strip():
            problems.append(f"feedback={self.feedback!r} must be a non-empty string (the user's reply)")
        problems += _check_dynamic_sampling(self.dynamic_sampling, self.n_samples)
        _raise_problems("MultiTurnWorkflow", problems)

    async def arun_episode(self, engine: RolloutEngine, data: dict[str, Any]) -> list[Trajectory] | None:
        """One trajectory per conversation (its last answer), by sample index; None when rejected."""
        prompt = render_prompt(data, self.tokenizer, self.prompt_key, self.chat_template_kwargs)
        fields = reward_fields(data, prompt.key)
        group_id = self._ids.next()
        request = GenerationRequest(
            rid=group_id, input_ids=prompt.ids, sampling=self.sampling, n_samples=self.n_samples
        )
        scorer = self._scorer(fields, data[prompt.key])
        first_turns = await _generate_and_score(engine, request, scorer)
        trajectories = await asyncio.gather(
            *(self._converse(engine, group_id, r, scored, scorer, fields) for r, scored in first_turns)
        )
        if self.dynamic_sampling and len({t.reward for t in trajectories}) == 1:
            return None
        return list(trajectories)

    async def _converse(
        self,
        engine: RolloutEngine,
        group_id: str,
        result: GenerationResult,
        scored: Scored,
        scorer: Callable[[GenerationResult], Awaitable[Scored]],
        fields: dict[str, Any],
    ) -> Trajectory:
        """Continue one conversation from its scored first answer until it is right or out of turns."""
        (reward, scoring), sample_index = scored, result.sample_index
        turn_rewards = [reward]
        limit = getattr(engine, "max_model_len", None)  # the engine's context, where it says
        while reward < 1.0 and len(turn_rewards) < self.max_turns and result.stop_reason != "abort":
            next_ids = (*result.input_ids, *result.output_ids, *self._feedback_ids(result.output_ids))
            if limit is not None and len(next_ids) + 1 >= limit:
                break  # another turn would not fit the context: the conversation ends with this answer
            request = GenerationRequest(rid=self._ids.next(), input_ids=next_ids, sampling=self.sampling)
            ((result, (reward, scoring)),) = await _generate_and_score(engine, request, scorer)
            turn_rewards.append(reward)
        discounted = reward * self.turn_discount ** (len(turn_rewards) - 1)
        # `sample_index` is the first turn's: later turns are requests of their own (index 0)
        return _trajectory(
            result, discounted, group_id, sample_index, prompt=self._decode(result.input_ids, False),
            completion=self._decode(result.output_ids), data=dict(fields), turn_rewards=turn_rewards, **scoring,
        )  # fmt: skip

    def _scorer(
        self, fields: dict[str, Any], raw_prompt: Any
    ) -> Callable[[GenerationResult], Awaitable[Scored]]:
        async def score(result: GenerationResult) -> Scored:
            kwargs = dict(fields, prompt=self._decode(result.input_ids, False))
            kwargs.update(completion=self._decode(result.output_ids), prompt_ids=list(result.input_ids))
            kwargs.update(completion_ids=list(result.output_ids))
            kwargs[RAW_PROMPT_KEY] = raw_prompt
            return await score_reward(self.reward, self.reward_in_thread, kwargs)

        return score

    def _feedback_ids(self, answer_ids: Sequence[int]) -> tuple[int, ...]:
        """The tokens after an answer: end of the answer's turn, the feedback turn, start of the next answer.

        The answer's end-of-turn token is left out when the model generated it (its stop token)."""
        if self._separator is None:
            self._separator = tuple(
                feedback_separator_ids(self.tokenizer, self.feedback, self.chat_template_kwargs)
            )
        sep = self._separator
        return sep[1:] if answer_ids and sep and answer_ids[-1] == sep[0] else sep

    def _decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


_ANSWER_MARKER = "\x1fladen-answer\x1f"


def feedback_separator_ids(
    tokenizer: Any, feedback: str, chat_template_kwargs: Mapping[str, Any] | None = None
) -> list[int]:
    """What the chat template puts between an assistant answer's text and the next answer's text when a
    user turn `feedback` comes between them, as tokens (rendered once, from a probe conversation).

    Without a chat template: `"\\n" + feedback + "\\n"`, appended as text.
    """
    if not getattr(tokenizer, "chat_template", None):
        return _encode(tokenizer, f"\n{feedback}\n")
    probe = [
        {"role": "user", "content": "question"},
        {"role": "assistant", "content": _ANSWER_MARKER},
        {"role": "user", "content": feedback},
    ]
    text = tokenizer.apply_chat_template(
        probe, tokenize=False, add_generation_prompt=True, **dict(chat_template_kwargs or {})
    )
    if text.count(_ANSWER_MARKER) != 1:
        raise ValueError(
            f"the chat template of {_tokenizer_name(tokenizer)} does not render an assistant turn's content "
            "verbatim, so the feedback turn cannot be appended as tokens; use MultiTurnWorkflow with a "
            "template that does (ChatML, Llama 3, Qwen)"
        )
    return _encode(tokenizer, text.split(_ANSWER_MARKER)[1])


def _trajectory(
    result: GenerationResult, reward: float, group_id: str, sample_index: int, **info: Any
) -> Trajectory:
    return Trajectory(
        prompt_ids=tuple(result.input_ids), completion_ids=list(result.output_ids),
        logprobs=list(result.output_logprobs), versions=list(result.output_versions), reward=float(reward),
        stop_reason=result.stop_reason, group_id=group_id, sample_index=sample_index, info=info,
    )  # fmt: skip


# --- loading by import path ----------------------------------------------------------------------


def import_object(spec: str, field: str = "workflow", *, callable_as: str | None = None) -> Any:
    """The object `spec` names: "package.module:attr" (attr may be dotted) or AReaL's "package.module.attr".

    Raises `ValueError` (`laden.import_path.ImportPathError`) naming `field` and what is wrong: the path's
    form, a missing module or a package it imports, an import that raised, a missing attribute, and, with
    `callable_as` (what it must be, e.g. "a class or factory"), an object that is not callable.
    """
    fix = f"set {field} to `package.module:Name`"
    if isinstance(spec, str) and spec.split(".")[0].split(":")[0] == "areal":
        fix += (
            "; AReaL's own agents need the areal package with all its requirements (aiohttp first among them); "
            "laden runs them unchanged once they import, or set workflow to an agent class of your own (docs/agents.md)"
        )
    return resolve_import_path(spec, field=field, fix=fix, callable_as=callable_as)


def load_workflow(spec: str, **kwargs: Any) -> RolloutWorkflow:
    """Build the workflow `spec` names ("package.module:Class", or a factory) with `kwargs`.

    Raises `ValueError` naming what is wrong: the path's form, a missing module or attribute,
    arguments the class does not take, or an object without `async def arun_episode`.
    """
    factory = import_object(spec, callable_as="a class or factory")
    try:
        workflow = factory(**kwargs)
    except TypeError as exc:
        raise ValueError(f"workflow {spec!r} does not take the arguments {sorted(kwargs)}: {exc}") from exc
    if not inspect.iscoroutinefunction(getattr(workflow, "arun_episode", None)):
        raise ValueError(
            f"workflow {spec!r} built a {type(workflow).__name__}, which has no `async def arun_episode(engine, "
            "data)`; a workflow must implement laden.rl.workflow.RolloutWorkflow (or name an agent class, with "
            "`async def run(self, data, **extra_kwargs)`: laden.rl.agent)"
        )
    return workflow
