"""What the math agents share: the client, the row's opening messages, the final answer in a reply, and its
correctness."""

from __future__ import annotations

import re
from typing import Any

import openai
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessage

from laden.tools.calculator import CalculatorError, evaluate_arithmetic

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?")


def opening_messages(data: dict[str, Any], system_prompt: str | None) -> list[dict[str, Any]]:
    """The conversation an episode starts from: the row's `messages`, else its `prompt` (or `question`) as a user
    turn; `system_prompt` first unless the row has a system turn. `KeyError` naming the fields when it has none."""
    if "messages" in data:
        messages = [dict(m) for m in data["messages"]]
    else:
        text = data.get("prompt", data.get("question"))
        if text is None:
            raise KeyError(
                f"the row has none of 'messages', 'prompt' or 'question' (its fields: {sorted(data)})"
            )
        messages = [{"role": "user", "content": str(text)}]
    if system_prompt and not any(m.get("role") == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def final_answer(text: str | None) -> str | None:
    """The answer a reply gives: the last `\\boxed{...}`, else its last number (a fraction `a/b` counts as one)."""
    text = text or ""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(" ", "") if numbers else None


def is_correct(answer: str | None, reference: Any, *, tolerance: float = 1e-6) -> bool:
    """Whether `answer` is the number `reference` is (both read by the safe calculator, so `7/2` equals `3.5`)."""
    if answer is None:
        return False
    try:
        got, want = evaluate_arithmetic(answer), evaluate_arithmetic(str(reference))
    except CalculatorError:
        return answer.strip() == str(reference).strip()
    return abs(got - want) <= tolerance * max(1.0, abs(want))


def reference_answer(data: dict[str, Any]) -> Any:
    """The row's `answer` (`KeyError` naming the row's fields when it has none)."""
    if "answer" not in data:
        raise KeyError(
            f"the row has no 'answer' to check the agent's answer against (its fields: {sorted(data)})"
        )
    return data["answer"]


def endpoint_client(extra_kwargs: dict[str, Any], timeout: float = 600.0) -> AsyncOpenAI:
    """The client of the episode's endpoint: `base_url` and `api_key` from `run`'s keyword arguments (None: the
    OPENAI_BASE_URL / OPENAI_API_KEY environment, as the openai package reads it). No retries, so that a refused
    call ends the episode instead of being sent again; `timeout` seconds for every part of a call, connecting
    included (the openai package's own connect timeout, 5 s, is too short for an endpoint whose event loop a
    large batch keeps busy: such calls fail with APITimeoutError and their rows are rejected)."""
    return AsyncOpenAI(base_url=extra_kwargs.get("base_url"), api_key=extra_kwargs.get("api_key"), max_retries=0,
                       timeout=timeout)  # fmt: skip


def sampling_args(max_tokens: int, temperature: float | None) -> dict[str, Any]:
    """A call's sampling arguments: `max_tokens`, and `temperature` unless None (the run's `gconfig` decides)."""
    return {"max_tokens": max_tokens} | ({} if temperature is None else {"temperature": temperature})


async def reply(
    client: AsyncOpenAI, messages: list[Any], sampling: dict[str, Any], **request: Any
) -> ChatCompletionMessage | None:
    """The model's next message, or None when the endpoint refuses the call (HTTP 400: the conversation no longer
    leaves room for a reply in the context), which ends the episode."""
    try:
        response = await client.chat.completions.create(
            model="default", messages=messages, **sampling, **request
        )
    except openai.BadRequestError:
        return None
    return response.choices[0].message
