"""Which fields a job reads, so a run can say which of the fields set in its config it does not.

Every field of the tree is parsed for every job (one YAML serves `laden sft` and `laden rl`),
but not every field does something in every job or engine: the rollout, generation and
weight-update fields act in RL only, each engine's own section (`actor.fsdp.*`,
`actor.roundpipe.*`) under that engine only. A field set to something other than its default
where it has no effect is reported once at start-up, with where it takes effect, instead of
being ignored in silence.
"""

from __future__ import annotations

from typing import Any

from laden.config.loader import config_to_dict
from laden.config.schema import LadenConfig

# (field or section prefix, the jobs that read it, where it takes effect)
_RL_ONLY = "`laden rl` (generation and weight updates)"
_READERS: tuple[tuple[str, frozenset[str], str], ...] = (
    ("gconfig", frozenset({"rl"}), _RL_ONLY),
    ("rollout", frozenset({"rl"}), _RL_ONLY),
    ("sglang", frozenset({"rl"}), "`laden rl` with rollout.backend=sglang"),
    ("native", frozenset({"rl"}), "`laden rl` with rollout.backend=native"),
    ("max_concurrent_rollouts", frozenset({"rl"}), _RL_ONLY),
    ("actor.weight_update_mode", frozenset({"rl"}), _RL_ONLY),
    ("actor.weight_chunked_mem_mb", frozenset({"rl"}), _RL_ONLY),
    ("train_dataset.answer_key", frozenset({"rl"}), "`laden rl` (the reward function's reference answer)"),
    ("valid_dataset.answer_key", frozenset({"rl"}), "`laden rl` (the reward function's reference answer)"),
)
_ENGINE_SECTIONS = {"fsdp": "actor.fsdp", "roundpipe": "actor.roundpipe"}


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A config as plain nested dicts (`config_to_dict`, or YAML read back) -> `{dotted.name: value}`."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: tree}


def _default_of(field_name: str, defaults: dict[str, Any]) -> Any:
    if field_name in defaults:
        return defaults[field_name]
    section = field_name.split(".", 1)
    if section[0] == "valid_dataset":  # an optional section: compare with a dataset's defaults
        return defaults.get(f"train_dataset.{section[1]}")
    return None


def fields_without_effect(cfg: LadenConfig, *, job: str, engine: str) -> list[str]:
    """One line per field set away from its default that `job` on `engine` does not read."""
    defaults = flatten(config_to_dict(LadenConfig()))
    lines = []
    for name, value in flatten(config_to_dict(cfg)).items():
        if value == _default_of(name, defaults):
            continue
        where = _where(name, job, engine)
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
