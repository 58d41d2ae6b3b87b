"""AReaL's OpenAI Agents SDK example (`agent_builder_path`): an SDK agent run against the endpoint, scored by the reward.

`agent_builder_path` names a function returning an `agents.Agent` (built with `agent_builder_kwargs`);
`OpenAIAgentsRunner.run` builds one per episode, runs it with `agents.Runner` on the row's last message
through an `AsyncOpenAI` client on the episode's `base_url` and `api_key` (chat completions: the endpoint
serves no Responses API), and scores its `final_output` with the run's reward (`reward_fn`, or AReaL's
`reward_fn_path`) as the completion, the row's other fields as its keyword arguments. Needs the
`openai-agents` package (`pip install openai-agents`).
"""

from __future__ import annotations

from typing import Any

from laden.rl.reward_styles import RAW_PROMPT_KEY
from laden.rl.workflow import import_object, reward_fields, score_reward


def require_openai_agents(builder_path: str) -> None:
    """`ValueError` naming the package when the OpenAI Agents SDK does not import."""
    try:
        import agents  # noqa: F401
    except ImportError as err:
        raise ValueError(
            f"agent_builder_path={builder_path!r} runs an OpenAI Agents SDK agent, which needs the openai-agents "
            f"package ({err}); pip install openai-agents"
        ) from err


class OpenAIAgentsRunner:
    """An agent (AReaL's contract) that runs an OpenAI Agents SDK agent (see the module docstring)."""

    def __init__(self, *, builder_path: str, builder_kwargs: dict[str, Any], reward: Any) -> None:
        require_openai_agents(builder_path)
        self.builder = import_object(builder_path, "agent_builder_path")
        self.builder_kwargs = builder_kwargs
        self.reward = reward

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float:
        from agents import OpenAIProvider, RunConfig, Runner
        from openai import AsyncOpenAI

        client = AsyncOpenAI(
            base_url=extra_kwargs["base_url"], api_key=extra_kwargs["api_key"], max_retries=0
        )
        provider = OpenAIProvider(openai_client=client, use_responses=False)
        question = data["messages"][-1]["content"] if "messages" in data else data["prompt"]
        result = await Runner.run(
            self.builder(**self.builder_kwargs), input=question,
            run_config=RunConfig(model_provider=provider, tracing_disabled=True),
        )  # fmt: skip
        key = "messages" if "messages" in data else "prompt"
        kwargs = dict(reward_fields(data, key), prompt=str(question), completion=str(result.final_output))
        kwargs.update(prompt_ids=[], completion_ids=[], **{RAW_PROMPT_KEY: data[key]})
        reward, _ = await score_reward(self.reward, False, kwargs)
        return reward
