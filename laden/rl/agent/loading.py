"""The run's workflow from the config: a `RolloutWorkflow` by import path, or an agent wrapped in `AgentWorkflow`.

`workflow` (and `eval_workflow` for `laden rl`'s evaluation; None: `workflow`) names either a rollout
workflow (a class or factory of objects with `async def arun_episode(engine, data)`, built with the
tokenizer, sampling, `n_samples`, reward and dynamic sampling, as before) or an agent class: a class
with `async def run(self, data, **extra_kwargs)` and no `arun_episode`. An agent class is built with
`agent_run_args` (plus `max_turns` when set and not among them) and wrapped in `AgentWorkflow` with the
`rollout.agent` settings; its group is `n_trajs` runs (else `gconfig.n_samples`). `agent_builder_path`
(AReaL's OpenAI Agents SDK example) replaces `workflow` with laden's runner of that SDK
(`laden.rl.agent.openai_agents`).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from laden.config import LadenConfig
from laden.rl.agent.workflow import AgentWorkflow
from laden.rl.workflow import RolloutWorkflow, import_object, load_workflow
from laden.rollout.base import SamplingParams

log = logging.getLogger("laden.rl")

_AGENT_ONLY = ("agent_run_args", "max_turns", "n_trajs", "max_tokens_per_trajectory", "export_style",
               "turn_discount", "agent_builder_kwargs")  # fmt: skip


def is_agent_class(target: Any) -> bool:
    """Whether `target` is an agent class: `async def run` and no `arun_episode`."""
    return (
        inspect.isclass(target)
        and inspect.iscoroutinefunction(getattr(target, "run", None))
        and not hasattr(target, "arun_episode")
    )


def build_workflow(
    cfg: LadenConfig, *, tokenizer: Any, sampling: SamplingParams, n_samples: int, reward: Any,
    dynamic_sampling: bool = False, evaluation: bool = False,
) -> RolloutWorkflow:  # fmt: skip
    """The training workflow (or, with `evaluation`, the evaluation's) that `cfg` names (module docstring)."""
    field = "eval_workflow" if evaluation and cfg.eval_workflow else "workflow"
    spec = getattr(cfg, field)
    if cfg.agent_builder_path:
        from laden.rl.agent.openai_agents import OpenAIAgentsRunner

        agent: Any = OpenAIAgentsRunner(
            builder_path=cfg.agent_builder_path, builder_kwargs=dict(cfg.agent_builder_kwargs), reward=reward
        )
    else:
        target = import_object(spec, field)
        if not is_agent_class(target):
            return load_workflow(spec, tokenizer=tokenizer, sampling=sampling, n_samples=n_samples, reward=reward,
                                 **({} if evaluation else {"dynamic_sampling": dynamic_sampling}))  # fmt: skip
        agent = _build_agent(target, spec, field, cfg)
    a = cfg.rollout.agent
    return AgentWorkflow(
        agent=agent, tokenizer=tokenizer, sampling=sampling,
        n_samples=n_samples if evaluation else (cfg.n_trajs or n_samples), export_style=a.export_style,
        turn_discount=a.turn_discount, chat_template_type=a.chat_template_type, max_total_tokens=a.engine_max_tokens,
        tool_call_parser=a.tool_call_parser, mode=a.mode, subproc_max_workers=a.subproc_max_workers,
        dynamic_sampling=dynamic_sampling and not evaluation, evaluation=evaluation,
    )  # fmt: skip


def check_workflow_imports(cfg: LadenConfig) -> bool:
    """Import what `workflow`, `eval_workflow` and `agent_builder_path` name, before the model is loaded (a
    `ValueError` names the path and the package it lacks); whether the run calls the reward (`reward_fn`):
    not when both workflows are agents, whose `run` returns the rewards."""
    if cfg.agent_builder_path:
        from laden.rl.agent.openai_agents import require_openai_agents

        require_openai_agents(cfg.agent_builder_path)
        import_object(cfg.agent_builder_path, "agent_builder_path")
        return True  # the runner scores the SDK agent's final output with the reward
    agents = [
        is_agent_class(import_object(getattr(cfg, f), f))
        for f in ("workflow", "eval_workflow")
        if getattr(cfg, f)
    ]
    return not all(agents)


def agent_kwargs(cfg: LadenConfig) -> dict[str, Any]:
    """The agent constructor's keyword arguments: `agent_run_args`, and `max_turns` when set and not among them."""
    kwargs = dict(cfg.agent_run_args)
    if cfg.max_turns is not None:
        kwargs.setdefault("max_turns", cfg.max_turns)
    return kwargs


def _build_agent(target: type, spec: str, field: str, cfg: LadenConfig) -> Any:
    kwargs = agent_kwargs(cfg)
    try:
        return target(**kwargs)
    except TypeError as err:
        raise ValueError(
            f"{field} {spec!r} is an agent class, built with agent_run_args (and max_turns) {sorted(kwargs)}, "
            f"but its constructor refuses them: {err}; fix agent_run_args"
        ) from err


def warn_unused_agent_settings(cfg: LadenConfig, workflow: Any) -> None:
    """Say at start-up which settings the run's workflow does not read: the agent fields without an agent, and
    `reward_fn` with one (the agent's `run` returns the rewards), unless `agent_builder_path` scores with it."""
    default = LadenConfig()
    if isinstance(workflow, AgentWorkflow):
        if not cfg.agent_builder_path and (cfg.reward_fn != default.reward_fn or cfg.reward_fns):
            log.warning("reward_fn%s is not called: workflow %s is an agent, whose run() returns the rewards",
                        "s" if cfg.reward_fns else f"={cfg.reward_fn!r}", cfg.workflow)  # fmt: skip
        return
    changed = [f for f in _AGENT_ONLY if getattr(cfg, f) != getattr(default, f)]
    changed += [f"rollout.agent.{f}" for f in ("mode", "tool_call_parser", "chat_template_type", "engine_max_tokens",
                                               "turn_discount", "export_style")
                if getattr(cfg.rollout.agent, f) != getattr(default.rollout.agent, f)]  # fmt: skip
    if changed:
        log.warning("%s: without effect, workflow %s is not an agent class (an agent has `async def run(self, data, "
                    "**extra_kwargs)`; laden.rl.agent)", ", ".join(changed), cfg.workflow)  # fmt: skip
