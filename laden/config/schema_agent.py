"""The agent settings of the config tree (`laden.rl.agent`): AReaL's `rollout.agent` section, and the top-level
fields AReaL's agentic examples add to their configs (`agent_run_args`, `export_style`, `n_trajs`, ...).

`AgentFields` holds the top-level ones; `LadenConfig` takes them by inheritance so that they keep AReaL's
top-level names while `schema.py` stays one section per class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(kw_only=True, slots=True)
class AgentConfig:
    """How agent workflows reach the rollout engine (AReaL's `rollout.agent`): the OpenAI-compatible endpoint."""

    mode: Literal["inline", "subproc"] = "inline"
    """`inline`: the agent's `run` is awaited on the trainer's event loop (it must not block it: use
    `AsyncOpenAI`); `subproc`: each run goes to a worker process (`subproc_max_workers` of them) with
    OPENAI_BASE_URL and OPENAI_API_KEY set to its own session, for agent code that blocks or reads the
    environment (the agent must be picklable)."""
    tool_call_parser: str = "auto"
    """The model's tool-call format: `auto` reads it from the chat template (`<tool_call>{json}</tool_call>`
    for Qwen / Hermes templates, else none); `hermes`, `qwen`, `qwen25`, `qwen3` name that format."""
    reasoning_parser: str = "qwen3"
    """AReaL's reasoning parser; laden returns `<think>` text as part of the content, as AReaL's client does."""
    chat_template_type: Literal["hf", "concat"] | None = None
    """`hf`: every call's messages rendered whole by the chat template; `concat`: a call that continues an
    earlier one is prompted with that call's own tokens plus the new turns; None: `concat` when
    `export_style` is concat, else `hf`."""
    engine_max_tokens: int | None = None
    """The most tokens (prompt plus completion) of one call; None: the engine's context. Same as the
    top-level `max_tokens_per_trajectory` (the smaller applies when both are set)."""
    turn_discount: float = 1.0
    """A call's reward is its own plus this times the next call's (discounted) reward (AReaL's); the
    top-level `turn_discount` replaces it when set."""
    export_style: Literal["individual", "concat"] = "individual"
    """`individual`: every call is one training sample; `concat`: one sample per conversation, trained
    on the model's turns only; the top-level `export_style` replaces it when set."""
    subproc_max_workers: int = 4
    """Worker processes of `mode: subproc` (episodes beyond them wait)."""


@dataclass(kw_only=True, slots=True)
class AgentFields:
    """The top-level fields of agent workflows (AReaL's agentic examples)."""

    eval_workflow: str | None = None
    """Import path of the workflow or agent class of `laden rl`'s held-out evaluation; None: `workflow`."""
    agent_run_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the agent class's constructor (when `workflow` names an agent: a class with
    `async def run(self, data, **extra_kwargs)`)."""
    max_turns: int | None = None
    """Passed to the agent's constructor as `max_turns` (unless `agent_run_args` has it); None: not passed."""
    n_trajs: int | None = None
    """Agent runs per prompt (the group an advantage is normalised in); None: `gconfig.n_samples`."""
    max_tokens_per_trajectory: int | None = None
    """The most tokens (prompt plus completion) of one call of an agent; None: the engine's context."""
    export_style: Literal["individual", "concat"] | None = None
    """How an agent's calls become training samples (`rollout.agent.export_style`); None: that field."""
    turn_discount: float | None = None
    """Discount of rewards propagated back over an agent's calls (`rollout.agent.turn_discount`); None: that field."""
    agent_builder_path: str | None = None
    """Import path of a function returning an OpenAI Agents SDK `Agent` (AReaL's openai_agents example):
    laden runs it with `agents.Runner` against the endpoint and scores its final output with `reward_fn`
    (needs the `openai-agents` package); `workflow` is then not read."""
    agent_builder_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of `agent_builder_path`'s function."""
    reward_fn_path: str | None = None
    """AReaL's name of the reward function of the `agent_builder_path` example: the same as `reward_fn`."""
