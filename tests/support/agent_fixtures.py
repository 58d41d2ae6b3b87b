"""Agents (AReaL's `async def run(self, data, **extra_kwargs)` contract) and a scripted rollout engine for the
agent tests; a module of its own so that `laden rl` (and its worker processes) can import them by path."""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI

from laden.rollout.base import GenerationResult

QWEN_TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    '</tools>\nCall a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message.get('tool_calls') %}<|im_start|>assistant\n"
    "{{ message['content'] }}{% for call in message['tool_calls'] %}<tool_call>\n"
    "{\"name\": \"{{ call['function']['name'] }}\", \"arguments\": {{ call['function']['arguments'] | tojson }}}\n"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A Qwen 2.5-style chat template (tools in the system turn, `<tool_call>` blocks, tool results as user turns)."""


def share_of_a(text: str | None) -> float:
    text = text or ""
    return text.count("a") / max(len(text), 1)


class LetterAgent:
    """Answers, then is asked again for up to `max_turns` turns; each answer's reward is its share of 'a'.

    Returns `{completion id: reward}` with `per_call` (every call scored), else the last answer's reward.
    """

    def __init__(self, max_turns: int = 2, per_call: bool = False, max_tokens: int = 6) -> None:
        self.max_turns = max_turns
        self.per_call = per_call
        self.max_tokens = max_tokens

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float | dict[str, float]:
        client = AsyncOpenAI(
            base_url=extra_kwargs["base_url"], api_key=extra_kwargs["api_key"], max_retries=0
        )
        messages = [{"role": "user", "content": data["prompt"]}]
        rewards: dict[str, float] = {}
        reward = 0.0
        for _ in range(self.max_turns):
            response = await client.chat.completions.create(
                model="policy", messages=messages, max_tokens=self.max_tokens
            )
            message = response.choices[0].message
            reward = rewards[response.id] = share_of_a(message.content)
            messages.append(message.model_dump(exclude_none=True))
            messages.append({"role": "user", "content": "again"})
        await client.close()
        return rewards if self.per_call else reward


class FailingAgent:
    """Agent code with a bug: it reads a field the rows do not have."""

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float:
        return float(len(data["question"]))


class ScriptedEngine:
    """A `RolloutEngine` that answers every request with the next of `outputs` (token ids), log-prob -0.5 each,
    at weight version `version`; it records the requests."""

    def __init__(self, outputs: list[list[int]], *, version: int = 3) -> None:
        self.outputs = list(outputs)
        self.requests: list[Any] = []
        self.version = version

    async def generate(self, requests):
        for request in requests:
            self.requests.append(request)
            ids = self.outputs.pop(0)
            yield GenerationResult(
                rid=request.rid, sample_index=0, input_ids=request.input_ids, output_ids=list(ids),
                output_logprobs=[-0.5] * len(ids), output_versions=[self.version] * len(ids), stop_reason="stop",
            )  # fmt: skip

    async def close(self) -> None:
        pass


class EnvAgent:
    """Agent code that reads the endpoint from the environment (OPENAI_BASE_URL, OPENAI_API_KEY), with the blocking
    client when `blocking` (for `rollout.agent.mode: subproc`) else the asynchronous one; one call, its share of 'a'."""

    def __init__(self, blocking: bool = True) -> None:
        self.blocking = blocking

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float:
        from openai import AsyncOpenAI, OpenAI

        messages = [{"role": "user", "content": data["prompt"]}]
        if self.blocking:
            reply = OpenAI(max_retries=0).chat.completions.create(
                model="policy", messages=messages, max_tokens=4
            )
        else:
            reply = await AsyncOpenAI(max_retries=0).chat.completions.create(
                model="policy", messages=messages, max_tokens=4
            )
        return share_of_a(reply.choices[0].message.content)


def build_sdk_agent(instructions: str = "Answer with the letter a.") -> Any:
    """An OpenAI Agents SDK agent (AReaL's `agent_builder_path` example), for `laden.rl.agent.openai_agents`."""
    from agents import Agent

    return Agent(name="letters", instructions=instructions)


def text_length_reward(
    prompt: str, completion: str, prompt_ids: list, completion_ids: list, **fields: Any
) -> float:
    """The completion's length in characters (a reward that tells which text it scored)."""
    return float(len(completion))
