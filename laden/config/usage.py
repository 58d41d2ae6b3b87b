"""Which fields a job reads, so a run can say which of the fields set in its config it does not.

Every field of the tree is parsed for every job (one YAML serves `laden sft` and `laden rl`),
but not every field does something in every job or engine: the rollout, generation,
weight-update, PPO-loss, reward and advantage fields act in RL only, each engine's own section
(`actor.fsdp.*`, `actor.roundpipe.*`) under that engine only. A field set to something other than its default
where it has no effect is reported once at start-up, with where it takes effect, instead of
being ignored in silence.
"""

from __future__ import annotations

import functools
from typing import Any

from laden.config.alloc import AllocationMode
from laden.config.docs import sections
from laden.config.loader import config_to_dict
from laden.config.schema import LadenConfig

# (field or section prefix, the jobs that read it, where it takes effect)
_RL_ONLY = "`laden rl` (generation and weight updates)"
_RL_LOSS = "`laden rl` (the PPO loss, rewards and advantages)"
_RL_REWARDS = "`laden rl` (rollouts and rewards)"
_RL_ACTOR_FIELDS = (
    "group_size", "ppo_n_minibatches", "eps_clip", "eps_clip_higher", "c_clip", "importance_sampling_level",
    "loss_agg_mode", "temperature", "reward_scaling", "reward_bias", "reward_clip", "overlong_reward_penalty",
    "overlong_tokens", "overlong_penalty_factor", "mask_no_eos_with_zero", "discount", "gae_lambda", "kl_ctl",
    "kl_estimator", "recompute_logprob", "use_decoupled_loss", "behav_imp_weight_cap", "dynamic_sampling",
    "reward_norm", "adv_norm",
)  # fmt: skip
_READERS: tuple[tuple[str, frozenset[str], str], ...] = (
    ("gconfig", frozenset({"rl"}), _RL_ONLY),
    ("rollout", frozenset({"rl"}), _RL_ONLY),
    ("vllm", frozenset({"rl"}), "`laden rl` with rollout.backend=vllm"),
    ("sglang", frozenset({"rl"}), "`laden rl` with rollout.backend=sglang"),
    ("native", frozenset({"rl"}), "`laden rl` with rollout.backend=native"),
    ("max_concurrent_rollouts", frozenset({"rl"}), _RL_ONLY),
    ("actor.weight_update_mode", frozenset({"rl"}), _RL_ONLY),
    ("actor.weight_chunked_mem_mb", frozenset({"rl"}), _RL_ONLY),
    ("train_dataset.answer_key", frozenset({"rl"}), "`laden rl` (the reward function's reference answer)"),
    ("valid_dataset.answer_key", frozenset({"rl"}), "`laden rl` (the reward function's reference answer)"),
    # `laden rl` evaluates by generating whatever it says; the field switches generation on for `laden sft`
    (
        "evaluator.generate",
        frozenset({"sft"}),
        "`laden sft` (`laden rl` always generates for its evaluation)",
    ),
    ("actor.beta", frozenset({"dpo"}), "`laden dpo` (DPO's loss)"),
    # the pair and PPO objectives always compute log-probs in chunks; the reward model's head has one row
    (
        "actor.chunked_loss",
        frozenset({"sft"}),
        "`laden sft` (its cross-entropy; the other jobs' losses are always chunked)",
    ),
    (
        "actor.loss_chunk_size",
        frozenset({"sft", "rl", "dpo"}),
        "`laden sft`, `laden rl` and `laden dpo` (log-probs over the vocabulary in token chunks)",
    ),
    ("actor.loss_type", frozenset({"dpo"}), "`laden dpo` (DPO's loss)"),
    *(
        (f"{ds}.{key}", frozenset({"dpo", "rw"}), "`laden dpo` and `laden rw` (preference pairs)")
        for ds in ("train_dataset", "valid_dataset")
        for key in ("chosen_key", "rejected_key")
    ),
    *(
        (f"{ds}.{key}", frozenset({"sft"}), "`laden sft` (prompt/completion and chat-message rows)")
        for ds in ("train_dataset", "valid_dataset")
        for key in ("completion_key", "messages_key")
    ),
    # every job evaluates the validation set whole: only the training order has a first step
    ("valid_dataset.fail_fast", frozenset(), "train_dataset.fail_fast (the training order)"),
    *((f"actor.{name}", frozenset({"rl"}), _RL_LOSS) for name in _RL_ACTOR_FIELDS),
    *(
        (name, frozenset({"rl"}), _RL_REWARDS)
        for name in (
            "reward_fn",
            "workflow",
            "reward_timeout_s",
            "reward_workers",
            "reward_fn_style",
            "reward_fns",
            "reward_error_tolerance",
            "reward_import_timeout_s",
            "reward_worker_max_calls",
            "reward_worker_max_rss_gb",
            "eval_gconfig",
        )
    ),
    ("critic", frozenset({"rl"}), "`laden rl` (PPO's value model)"),
    *(
        (name, frozenset({"rl"}), "`laden rl` with an agent workflow (laden.rl.agent)")
        for name in (
            "eval_workflow",
            "agent_run_args",
            "max_turns",
            "n_trajs",
            "max_tokens_per_trajectory",
            "export_style",
            "turn_discount",
            "agent_builder_path",
            "agent_builder_kwargs",
            "reward_fn_path",
        )
    ),
    ("teacher", frozenset({"rl"}), "`laden rl` (distillation from a teacher)"),
)
_ENGINE_SECTIONS = {"fsdp": "actor.fsdp", "roundpipe": "actor.roundpipe", "archon": "actor.archon"}
_SERVER_SECTIONS = ("vllm", "sglang")
"""Sections of the rollout servers' settings, read by `laden rl` (and `laden serve`) with that server backend."""


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A config as plain nested dicts (`config_to_dict`, or YAML read back) -> `{dotted.name: value}`."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: tree}


_SECTION = object()
"""Stands for a section that is present by default, so setting it to null counts as a change."""


@functools.cache
def _defaults() -> dict[str, Any]:
    """`{dotted.name: default}`; the fields of an optional section left unset by default (`valid_dataset`,
    `actor.reward_norm`) default to its type's defaults, so a section set to them reports nothing."""
    defaults = LadenConfig()
    out = flatten(config_to_dict(defaults))
    for section, cls in sections()[1:]:
        node: Any = defaults
        for part in section.split("."):
            node = getattr(node, part, None)
        if node is not None:
            out.setdefault(section, _SECTION)
        for name, value in flatten(config_to_dict(cls())).items():
            out.setdefault(f"{section}.{name}", value)
    return out


def fields_without_effect(cfg: LadenConfig, *, job: str, engine: str) -> list[str]:
    """One line per field set away from its default that `job` on `engine` does not read."""
    defaults = _defaults()
    critic = _critic_engine(cfg, engine)
    rollout = _rollout_backend(cfg)
    lines = []
    for name, value in flatten(config_to_dict(cfg)).items():
        if value == defaults.get(name):
            continue
        where = _where(name, job, engine) or _critic_where(name, critic) or _server_where(name, job, rollout)
        if where is not None:
            lines.append(
                f"{name}={value!r} has no effect in `laden {job}` on the {engine} engine; it takes effect in {where}"
            )
    return lines


def _where(name: str, job: str, engine: str) -> str | None:
    for prefix, jobs, where in _READERS:
        if (name == prefix or name.startswith(prefix + ".")) and job not in jobs:
            return where
    for other, section in _ENGINE_SECTIONS.items():
        if other != engine and name.startswith(section + "."):
            return f"actor.backend={other}:..."
    return None


def _rollout_backend(cfg: LadenConfig) -> str | None:
    try:
        return AllocationMode.parse(cfg.rollout.backend).backend
    except ValueError:
        return None  # reported by validation


def _server_where(name: str, job: str, rollout: str | None) -> str | None:
    """`vllm.*` / `sglang.*` in `laden rl` with another rollout backend."""
    section = name.partition(".")[0]
    if job == "rl" and rollout is not None and section in _SERVER_SECTIONS and section != rollout:
        return f"`laden rl` with rollout.backend={section}:..."
    return None


def _critic_engine(cfg: LadenConfig, engine: str) -> str:
    """The engine kind the critic trains on: `critic.backend`'s, else the actor's."""
    if cfg.critic is None or not cfg.critic.backend:
        return engine
    try:
        backend = AllocationMode.parse(cfg.critic.backend).backend
    except ValueError:
        return engine  # reported by validation
    return "archon" if backend == "megatron" else backend  # megatron: modes run on the archon engine


def _critic_where(name: str, critic_engine: str) -> str | None:
    for other in _ENGINE_SECTIONS:
        if other != critic_engine and name.startswith(f"critic.{other}."):
            return f"critic.backend={other}:..."
    return None
