"""An episode's recorded calls as training sequences: AReaL's `export_style`s.

- `individual`: every answered call is its own sample: its prompt, its completion (all trained on), its
  reward after the turn discount.
- `concat`: one sample per conversation: only the leaves of the conversation tree (calls no later call
  continues; `laden.rollout.openai_server.session` finds each call's parent) are exported, each as the
  whole conversation that leads to it. A call whose prompt tokens extend its parent's prompt and
  completion tokens exactly (what the endpoint's `concat` rendering gives) continues its parent's
  sequence: the parent's tokens keep their loss mask, log-probs and versions, the tokens between (the
  tool outputs and user turns) get loss mask 0, log-prob 0 and version -1, and the call's own
  completion loss mask 1. A call whose prompt does not extend its parent's tokens is exported as
  AReaL does in that case: its own prompt, loss-masked whole, then its completion (the parent's
  answer is then trained on in no sample, as in AReaL; a warning says so). The sample's reward is
  the leaf's, after the discount.

A sample's `prompt_ids` are the first call's prompt (never trained on) and its `completion_ids` all that
follows; the loss mask covers the completion.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from laden.rollout.openai_server.session import Interaction

log = logging.getLogger(__name__)

ExportStyle = Literal["individual", "concat"]
EXPORT_STYLES = ("individual", "concat")


@dataclass(kw_only=True, slots=True)
class Sample:
    """One training sequence of an episode."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    loss_mask: list[int]
    reward: float
    stop_reason: str
    """The last call's."""
    call_ids: list[str]
    """The completion ids of the calls it holds, first to last."""


def export_calls(calls: list[Interaction], style: ExportStyle) -> list[Sample]:
    """The samples of an episode's answered `calls` (in arrival order, rewards already discounted)."""
    if style == "individual":
        return [_alone(c) for c in calls]
    if style != "concat":
        raise ValueError(f"export_style={style!r} must be one of {EXPORT_STYLES}")
    kept = {id(c) for c in calls}
    parents = {id(c.parent) for c in calls if c.parent is not None and id(c.parent) in kept}
    return [_sequence(c, kept) for c in calls if id(c) not in parents]


def _alone(call: Interaction) -> Sample:
    return Sample(
        prompt_ids=list(call.prompt_ids), completion_ids=list(call.completion_ids), logprobs=list(call.logprobs),
        versions=list(call.versions), loss_mask=[1] * len(call.completion_ids), reward=float(call.reward or 0.0),
        stop_reason=call.stop_reason, call_ids=[call.id],
    )  # fmt: skip


_warned_fallback = False


def _sequence(call: Interaction, kept: set[int]) -> Sample:
    """The conversation that leads to `call`, as one sample (module docstring)."""
    parent = call.parent if call.parent is not None and id(call.parent) in kept else None
    if parent is None:
        return _alone(call)
    head = _sequence(parent, kept)
    whole = [*head.prompt_ids, *head.completion_ids]
    if len(call.prompt_ids) <= len(whole) or call.prompt_ids[: len(whole)] != whole:
        _warn_fallback(call, parent)
        return _alone(call)
    gap = len(call.prompt_ids) - len(whole)
    tail = call.prompt_ids[len(whole) :]
    return Sample(
        prompt_ids=head.prompt_ids, completion_ids=[*head.completion_ids, *tail, *call.completion_ids],
        logprobs=[*head.logprobs, *[0.0] * gap, *call.logprobs],
        versions=[*head.versions, *[-1] * gap, *call.versions],
        loss_mask=[*head.loss_mask, *[0] * gap, *[1] * len(call.completion_ids)],
        reward=float(call.reward or 0.0), stop_reason=call.stop_reason, call_ids=[*head.call_ids, call.id],
    )  # fmt: skip


def _warn_fallback(call: Interaction, parent: Interaction) -> None:
    global _warned_fallback
    if not _warned_fallback:
        _warned_fallback = True
        log.warning(
            "export_style concat: call %s continues call %s in its messages, but its prompt tokens do not extend "
            "that call's prompt and completion tokens (the conversation was re-rendered: set export_style: concat "
            "before the run so the endpoint extends prompts as tokens, or the agent changed earlier messages); "
            "it is exported on its own with its whole prompt masked, and its parent's answer is not trained on "
            "(AReaL's fallback). Said once.", call.id, parent.id,
        )  # fmt: skip
