"""Validation of the agent settings (`laden.config.schema_agent`), and the aliases they resolve to.

The top-level `export_style` and `turn_discount` (AReaL's agentic examples) and `rollout.agent`'s (AReaL's
own section) name the same settings; `reward_fn_path` is `reward_fn`, `max_tokens_per_trajectory` is
`rollout.agent.engine_max_tokens`. Two that disagree are an error; after validation `apply_agent_aliases`
copies the one that was set onto the other, so readers use `rollout.agent.*` and `reward_fn` only.
"""

from __future__ import annotations

from typing import Any

from laden.config.schema import LadenConfig
from laden.import_path import import_path_error

_PARSERS = ("auto", "hermes", "qwen", "qwen25", "qwen2_5", "qwen3")


def agent_errors(cfg: LadenConfig) -> list[str]:
    """Every agent-settings error: ranges, import paths, and aliases that disagree."""
    agent, errors = cfg.rollout.agent, []
    for dotted, value in (
        ("turn_discount", cfg.turn_discount),
        ("rollout.agent.turn_discount", agent.turn_discount),
    ):
        if value is not None and not 0 <= value <= 1:
            errors.append(f"{dotted}={value!r} must be in [0, 1] (1 = no discount); set it to e.g. 0.9")
    for dotted, value in (("n_trajs", cfg.n_trajs), ("max_tokens_per_trajectory", cfg.max_tokens_per_trajectory),
                          ("max_turns", cfg.max_turns), ("rollout.agent.engine_max_tokens", agent.engine_max_tokens),
                          ("rollout.agent.subproc_max_workers", agent.subproc_max_workers)):  # fmt: skip
        if value is not None and (isinstance(value, bool) or value < 1):
            errors.append(f"{dotted}={value!r} must be a positive integer (or null); set it to e.g. 4")
    for dotted in ("eval_workflow", "agent_builder_path", "reward_fn_path"):
        value = getattr(cfg, dotted)
        error = None if value is None else import_path_error(value, field=dotted, fix="write `module:name`")
        if error:
            errors.append(error)
    if str(agent.tool_call_parser).lower() not in _PARSERS:
        errors.append(
            f"rollout.agent.tool_call_parser={agent.tool_call_parser!r} is not a format laden parses; use one of "
            f"{', '.join(_PARSERS)} (`auto` reads it from the chat template)"
        )
    default = LadenConfig()
    pairs: tuple[tuple[str, str, Any, Any], ...] = (("export_style", "rollout.agent.export_style", cfg.export_style, agent.export_style),
             ("turn_discount", "rollout.agent.turn_discount", cfg.turn_discount, agent.turn_discount),
             ("reward_fn_path", "reward_fn", cfg.reward_fn_path, cfg.reward_fn))  # fmt: skip
    for top, other, value, other_value in pairs:
        unchanged = other_value == _get(default, other)
        if value is not None and value != other_value and not unchanged:
            errors.append(f"{top}={value!r} conflicts with {other}={other_value!r}; they name the same setting: "
                          "set only one")  # fmt: skip
    if cfg.reward_fn_path is not None and cfg.reward_fns:
        errors.append(
            "reward_fn_path is set beside reward_fns; reward_fns names every reward: remove reward_fn_path"
        )
    return errors


def apply_agent_aliases(cfg: LadenConfig) -> None:
    """Copy the top-level agent fields that are set onto what they alias (after `agent_errors` passed)."""
    agent = cfg.rollout.agent
    if cfg.export_style is not None:
        agent.export_style = cfg.export_style
    if cfg.turn_discount is not None:
        agent.turn_discount = cfg.turn_discount
    if cfg.reward_fn_path is not None:
        cfg.reward_fn = cfg.reward_fn_path
    limits = [n for n in (cfg.max_tokens_per_trajectory, agent.engine_max_tokens) if n is not None]
    if limits:
        agent.engine_max_tokens = min(limits)


def _get(cfg: object, dotted: str) -> object:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg
