"""OpenAI request bodies to prompts and sampling settings: messages, chat templates, parameters.

Two ways to turn a chat request into prompt tokens (AReaL's `chat_template_type`):

- `hf`: the whole conversation through the tokenizer's chat template, every call (rendered to text,
  then encoded without adding special tokens, as `laden.rl.workflow` renders prompts).
- `concat`: when the request continues an earlier call of its episode (its messages start with that
  call's messages and answer), the prompt is that call's prompt and completion tokens, as generated,
  followed by the template's tokens for the new messages: the conversation's earlier turns are never
  re-tokenised, so one sequence can hold the whole conversation and its log-probs stay the model's.
  The new tokens are found as AReaL does: the parent's tokens end with the end-of-sequence token
  (appended when its completion stopped without one), and the full re-rendering is cut after as many
  end-of-sequence tokens as the parent's tokens hold. A template that does not end turns with the
  end-of-sequence token cannot be cut so; that request falls back to `hf` (and its export to
  AReaL's fallback).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from laden.rollout.base import SamplingParams
from laden.rollout.openai_server.http import HTTPError


def normalize(value: Any) -> Any:
    """`value` with every None-valued key dropped, recursively (AReaL's message normalisation: a client's
    `model_dump()` of a message writes `None` for the fields it lacks)."""
    if isinstance(value, Mapping):
        return {k: normalize(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [normalize(v) for v in value]
    return value


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """The request's `messages`, normalised; `HTTPError(400)` unless a non-empty list of role dicts."""
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "'messages' must be a non-empty list of {'role', 'content'} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise HTTPError(400, f"messages[{i}] must be an object with a 'role', got {m!r:.200}")
    return [normalize(m) for m in messages]


def same_message(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two messages say the same: role, text (None = ''), and tool calls by name and arguments
    (the ids and extra fields a client adds to an assistant message it echoes back do not count)."""
    if a.get("role") != b.get("role") or _text(a.get("content")) != _text(b.get("content")):
        return False
    return _calls(a) == _calls(b) and a.get("tool_call_id") == b.get("tool_call_id")


def _calls(m: Mapping[str, Any]) -> list[tuple[Any, Any]]:
    out = []
    for call in m.get("tool_calls") or ():
        fn = call.get("function") or {}
        out.append((fn.get("name"), _arguments(fn.get("arguments"))))
    return out


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # content parts: their text, in order
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return str(content)


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: text content (parts joined, None as ''), and tool-call
    arguments as objects (OpenAI clients send them as JSON strings; templates serialise them)."""
    out = []
    for m in messages:
        m = dict(m)
        m["content"] = _text(m.get("content"))
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c.get("function", {}), "arguments": _arguments(c.get("function", {}).get("arguments"))}}
                for c in m["tool_calls"]
            ]  # fmt: skip
        out.append(m)
    return out


def render_chat(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: list[Any] | None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:  # fmt: skip
    """The `hf` prompt: the conversation through the chat template, with the generation prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise HTTPError(
            400, "the model's tokenizer has no chat template; use /v1/completions with a prompt string"
        )
    kwargs = dict(chat_template_kwargs or {})
    if tools:
        kwargs["tools"] = tools
    try:
        text = tokenizer.apply_chat_template(
            template_messages(messages), tokenize=False, add_generation_prompt=True, **kwargs
        )
    except Exception as err:  # noqa: BLE001 - a template error is the request's fault (a role it refuses)
        raise HTTPError(400, f"the chat template cannot render these messages: {err}") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def concat_prompt(parent_tokens: Sequence[int], full: Sequence[int], eos_id: int | None) -> list[int] | None:
    """The `concat` prompt (module docstring): `parent_tokens` (ending with end-of-sequence) then the part of
    `full` (the whole conversation rendered) after its k-th end-of-sequence token, k the count in
    `parent_tokens`; None when `full` cannot be cut there."""
    if eos_id is None:
        return None
    k = list(parent_tokens).count(eos_id)
    seen = 0
    for i, token in enumerate(full):
        if token == eos_id:
            seen += 1
            if seen == k:
                return [*parent_tokens, *full[i + 1 :]] if i + 1 < len(full) else None
    return None


def sampling_for(
    body: Mapping[str, Any], defaults: SamplingParams, *, prompt_len: int, max_total_tokens: int | None,
    eos_id: int | None,
) -> SamplingParams:  # fmt: skip
    """The request's sampling: its `temperature` (0 = greedy), `top_p`, `top_k`, `max_tokens` /
    `max_completion_tokens` and `stop` over `defaults` (the run's `gconfig`), the new tokens capped so prompt
    plus completion fit `max_total_tokens`; `HTTPError(400)` says what cannot be served."""
    if body.get("n") not in (None, 1):
        raise HTTPError(400, f"n={body['n']!r}: one completion per request; send n requests")
    if body.get("stream"):
        raise HTTPError(400, "stream=true is not supported by this endpoint; leave it out")
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise HTTPError(400, "give max_tokens or max_completion_tokens, not both")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    want = body.get(name)
    new = defaults.max_new_tokens if want is None else _positive_int(name, want)
    if max_total_tokens is not None:
        room = max_total_tokens - prompt_len
        if room < 1:
            raise HTTPError(
                400, f"the prompt has {prompt_len} tokens, leaving no room for a completion within "
                f"{max_total_tokens} tokens (the engine's context or max_tokens_per_trajectory); shorten the conversation",
            )  # fmt: skip
        new = min(new, room)
    changes: dict[str, Any] = {"max_new_tokens": new, "min_new_tokens": min(defaults.min_new_tokens, new)}
    temperature = body.get("temperature")
    if temperature is not None:
        temperature = _number("temperature", temperature)
        if temperature < 0:
            raise HTTPError(400, f"temperature={temperature!r} must be >= 0; use 0 for greedy decoding")
        changes.update(greedy=temperature == 0, temperature=temperature if temperature > 0 else 1.0)
    if body.get("top_p") is not None:
        top_p = _number("top_p", body["top_p"])
        if not 0 < top_p <= 1:
            raise HTTPError(400, f"top_p={top_p!r} must be in (0, 1] (1 = off); use temperature=0 for the most "
                            "likely token")  # fmt: skip
        changes["top_p"] = top_p
    if body.get("top_k") is not None:
        top_k = _number("top_k", body["top_k"])
        if not top_k.is_integer():
            raise HTTPError(400, f"top_k={top_k!r} must be a whole number of tokens (0 or -1 = off)")
        changes["top_k"] = max(0, int(top_k))  # vLLM's -1 (off) is laden's 0
    stop = body.get("stop")
    if stop is not None:
        if not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)
        ):
            raise HTTPError(400, f"stop={stop!r:.100} must be a string or a list of strings")
        changes["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
    if eos_id is not None and eos_id not in defaults.stop_token_ids:
        changes["stop_token_ids"] = (*defaults.stop_token_ids, eos_id)
    try:
        return replace(defaults, **changes)
    except ValueError as err:
        raise HTTPError(400, str(err)) from None


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HTTPError(400, f"{name}={value!r} must be a number")
    return float(value)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HTTPError(400, f"{name}={value!r} must be a positive integer")
    return value
