"""Tool-integrated reasoning: the model writes Python in a fenced block, laden's sandbox runs it, and the output
comes back as a tool turn.

A reply with a ```` ```python ```` block (the first one counts) has its code run in `laden.tools.sandbox` (a
subprocess in an empty directory, no network, bounded time, memory and output); what it printed, or its error,
is the next turn (role `output_role`), and the model is called again. A reply without code is the answer, and
the episode ends: reward 1.0 if it is correct, else 0.0, on the last call. At most `max_turns` model calls; a
reply with code on the last one ends the episode with its own answer, if any.
"""

from __future__ import annotations

import re
from typing import Any

from laden.tools.sandbox import arun_python
from math_agents.answers import (
    endpoint_client,
    final_answer,
    is_correct,
    opening_messages,
    reference_answer,
    reply,
    sampling_args,
)

SYSTEM_PROMPT = (
    "Solve the problem. You may write Python in a ```python block; it is run and its output is shown to you. "
    "Give the final answer as a number, for example \\boxed{42}."
)
_CODE = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)


def code_block(text: str | None) -> str | None:
    """The first fenced Python block in `text` (its code), or None."""
    match = _CODE.search(text or "")
    return match.group(1) if match else None


class TIRAgent:
    """See the module docstring. `agent_run_args`: `max_turns`, `max_tokens`, `temperature` (None: `gconfig`'s),
    `system_prompt`, `output_role` (`tool`, or `user` for a server that wants tool turns after tool calls only),
    and the sandbox's `timeout`, `memory_mb`, `max_output_chars`."""

    def __init__(
        self, max_turns: int = 4, max_tokens: int = 512, temperature: float | None = None,
        system_prompt: str | None = SYSTEM_PROMPT, output_role: str = "tool", timeout: float = 5.0,
        memory_mb: int = 1024, max_output_chars: int = 1024,
    ) -> None:  # fmt: skip
        if max_turns < 1:
            raise ValueError(f"TIRAgent: max_turns={max_turns} must be at least 1 (model calls an episode)")
        if output_role not in ("tool", "user"):
            raise ValueError(f"TIRAgent: output_role={output_role!r} must be 'tool' or 'user'")
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.system_prompt = system_prompt
        self.output_role = output_role
        self.sandbox = {"timeout": timeout, "memory_mb": memory_mb, "max_output_chars": max_output_chars}

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float:
        reference = reference_answer(data)
        messages: list[Any] = opening_messages(data, self.system_prompt)
        sampling = sampling_args(self.max_tokens, self.temperature)
        async with endpoint_client(extra_kwargs) as client:
            for turn in range(self.max_turns):
                message = await reply(client, messages, sampling)
                if message is None:
                    return 0.0
                content = message.content
                code = code_block(content)
                if code is None or turn == self.max_turns - 1:
                    return 1.0 if is_correct(final_answer(_without_code(content)), reference) else 0.0
                messages.append({"role": "assistant", "content": content or ""})
                result = await arun_python(code, **self.sandbox)
                messages.append({"role": self.output_role, "content": result.text()})
        return 0.0


def _without_code(text: str | None) -> str:
    """The reply with its code blocks removed (a number in the code is not the answer)."""
    return _CODE.sub("", text or "")
