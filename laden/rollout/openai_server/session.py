"""What one episode's calls to the OpenAI endpoint recorded, and their rewards (AReaL's `InteractionCache`).

An episode (one agent run) talks to the endpoint under its own session key. Each call is one
`Interaction`: the request's messages (chat) or prompt (completions), the prompt's token ids, the
completion's token ids, per-token log-probs and weight versions, the answer sent back, and a reward.
Interactions are kept in the order the calls arrived (what "last" means for a reward).

Rewards follow AReaL's contract: the agent's `run` returns a float (the reward of the last call) or
a dict `{completion id: reward}` (a NaN or infinite reward is refused, so its row is rejected); `apply_reward_discount(turn_discount)` then walks the calls from the
last to the first, an unset reward counting 0, each becoming its own reward plus `turn_discount` times
the next call's (already discounted) reward: `r[i] += turn_discount * r[i + 1]`.

A chat call's parent is the earlier call whose messages plus answer are the longest prefix of its
messages (AReaL's longest-prefix rule; messages compared by role, text and tool calls): the
conversation tree that `export_style: concat` exports leaf by leaf.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from laden.rollout.openai_server.chat import same_message

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True, eq=False)
class Interaction:
    """One call of an episode: its prompt and completion as tokens, and what the agent saw."""

    id: str
    """The completion id the agent got back (`chatcmpl-...` / `cmpl-...`): the key of a dict reward."""
    api: Literal["chat", "completion"]
    prompt_ids: list[int]
    """The tokens the engine conditioned on."""
    messages: list[dict[str, Any]] | None = None
    """The chat request's messages (None for a completions request)."""
    parent: Interaction | None = None
    """The earlier call this one continues (module docstring); None for a first turn."""
    concat: bool = False
    """Whether `prompt_ids` extend the parent's prompt and completion tokens exactly."""
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stop_reason: str = ""
    """The engine's: `stop`, `length` or `abort`."""
    output_message: dict[str, Any] | None = None
    """The assistant message sent back (chat); None until the call is answered."""
    reward: float | None = None

    @property
    def done(self) -> bool:
        """The call was answered (a failed or unanswered call is never exported)."""
        return self.output_message is not None or (self.api == "completion" and bool(self.stop_reason))


class Session:
    """The calls of one episode under `key`, in arrival order."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.interactions: dict[str, Interaction] = {}
        self._discounted = False

    def add(self, interaction: Interaction) -> None:
        if interaction.id in self.interactions:
            raise RuntimeError(f"completion id {interaction.id!r} recorded twice in session {self.key!r}")
        self.interactions[interaction.id] = interaction

    def find_parent(self, messages: Sequence[Mapping[str, Any]]) -> Interaction | None:
        """The answered chat call whose messages plus answer are the longest prefix of `messages`."""
        candidates = [i for i in self.interactions.values() if i.api == "chat" and i.done and i.messages]
        for call in sorted(candidates, key=lambda i: len(i.messages or ()), reverse=True):
            history = [*(call.messages or ()), call.output_message or {}]
            if len(history) <= len(messages) and all(same_message(a, b) for a, b in zip(history, messages)):
                return call
        return None

    def completed(self) -> list[Interaction]:
        """The answered calls, in arrival order."""
        return [i for i in self.interactions.values() if i.done]

    def set_reward(self, completion_id: str, reward: float) -> None:
        if completion_id not in self.interactions:
            raise KeyError(
                f"completion id {completion_id!r} is not a call of this episode (its calls: "
                f"{list(self.interactions)[:8]}); key a dict reward by the `id` of a completion the agent got"
            )
        self.interactions[completion_id].reward = float(reward)

    def assign(self, rewards: Any) -> None:
        """Set the agent's result: a number for the last call, or `{completion id: number}`."""
        if isinstance(rewards, Mapping):
            for cid, value in rewards.items():
                self.set_reward(str(cid), _number(value, f"the reward of {cid!r}"))
            unanswered = [str(cid) for cid in rewards if not self.interactions[str(cid)].done]
            if unanswered:  # a failed or aborted call is never exported, so neither is its reward
                log.warning(
                    "session %s: the agent's rewards for %d unanswered call(s) (%s) are dropped with them (a failed "
                    "or aborted call is not trained on); the answered calls keep theirs",
                    self.key, len(unanswered), ", ".join(unanswered[:4]),
                )  # fmt: skip
            return
        value = _number(rewards, "the agent's result")
        done = self.completed()
        if done:
            done[-1].reward = value

    def apply_reward_discount(self, turn_discount: float) -> None:
        """AReaL's backward propagation (module docstring); once per session."""
        if self._discounted:
            raise RuntimeError(f"the rewards of session {self.key!r} were already discounted")
        self._discounted = True
        calls = self.completed()
        if calls and calls[-1].reward is None:
            log.warning("an episode's last call has no reward (the agent returned rewards for other calls only); "
                        "it counts 0")  # fmt: skip
        running = 0.0
        for call in reversed(calls):
            running = running * turn_discount + (call.reward or 0.0)
            call.reward = running


def _number(value: Any, what: str) -> float:
    """`value` as a finite float (int, float, bool, numpy scalars, a one-element tensor); `TypeError` for
    anything else, `ValueError` for NaN or an infinity (which would reach every advantage of its group)."""
    if isinstance(value, numbers.Real):  # int, float, bool, numpy scalars
        number = float(value)
    elif hasattr(value, "numel") and value.numel() == 1:  # a one-element tensor
        number = float(value.item())
    else:
        raise TypeError(
            f"{what} is {value!r:.100}; an agent's run must return a number (the reward of its last call) or a "
            "dict {completion id: number}"
        )
    if not math.isfinite(number):
        raise ValueError(
            f"{what} is {number}; a reward must be a finite number: return a finite reward for a failed episode "
            "(e.g. 0.0), or raise to reject its row"
        )
    return number
