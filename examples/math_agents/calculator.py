"""A multi-turn math agent with a calculator tool, in OpenAI's tool-calling format.

Each model call may call the `calculator` tool (any number of calls in one reply); the results come back as
`tool` turns and the model is called again. A reply without tool calls is an answer: correct ends the episode
with reward 1; wrong gets a user turn saying so (with `feedback`) and another try. The episode has at most
`max_turns` model calls; its reward is 1.0 if its final answer was correct, else 0.0, on the last call (with
`turn_discount`, earlier calls get their discounted share).
"""

from __future__ import annotations

import json
from typing import Any

from laden.tools.calculator import CalculatorError, evaluate_arithmetic, format_number
from math_agents.answers import (
    endpoint_client,
    final_answer,
    is_correct,
    opening_messages,
    reference_answer,
    reply,
    sampling_args,
)

CALCULATOR_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example (12 + 7) * 3"}},
            "required": ["expression"],
        },
    },
}
SYSTEM_PROMPT = (
    "Solve the problem. Use the calculator tool for arithmetic. Give the final answer as a number, "
    "for example \\boxed{42}."
)


def call_calculator(name: str, arguments: str) -> str:
    """The tool turn's text for one call: the value, or the error the model should see."""
    if name != "calculator":
        return f"error: no tool named {name!r}; the only tool is 'calculator'"
    try:
        args = json.loads(arguments) if arguments else {}
    except ValueError:
        return 'error: the arguments are not JSON; call calculator with {"expression": "..."}'
    expression = args.get("expression") if isinstance(args, dict) else None
    try:
        return format_number(evaluate_arithmetic(expression))  # type: ignore[arg-type]
    except CalculatorError as err:
        return f"error: {err}"


class CalculatorAgent:
    """See the module docstring. `agent_run_args`: `max_turns`, `max_tokens` (per call), `temperature` (None:
    the run's `gconfig`), `system_prompt` (None: none), `feedback` (whether a wrong answer gets another try)."""

    def __init__(
        self, max_turns: int = 4, max_tokens: int = 256, temperature: float | None = None,
        system_prompt: str | None = SYSTEM_PROMPT, feedback: bool = True,
    ) -> None:  # fmt: skip
        if max_turns < 1:
            raise ValueError(
                f"CalculatorAgent: max_turns={max_turns} must be at least 1 (model calls an episode)"
            )
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.system_prompt = system_prompt
        self.feedback = feedback

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float:
        reference = reference_answer(data)
        messages: list[Any] = opening_messages(data, self.system_prompt)
        sampling = sampling_args(self.max_tokens, self.temperature)
        async with endpoint_client(extra_kwargs) as client:
            for _ in range(self.max_turns):
                message = await reply(client, messages, sampling, tools=[CALCULATOR_TOOL])
                if message is None:
                    break
                messages.append(message.model_dump(exclude_none=True))
                if message.tool_calls:
                    for call in message.tool_calls:
                        result = call_calculator(call.function.name, call.function.arguments)
                        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
                    continue
                answer = final_answer(message.content)
                if is_correct(answer, reference):
                    return 1.0
                if not self.feedback:
                    break
                said = "no number" if answer is None else answer
                messages.append({"role": "user", "content": f"Your answer ({said}) is wrong. Try again."})
        return 0.0
