"""The RL settings of a `LadenConfig`: the PPO loss, the advantages, the value loss, and what `laden rl` ignores.

The config holds AReaL's flat `actor.*` names (so AReaL's YAML sets them); the RL modules take
small frozen settings that validate themselves (`PPOSettings`, `AdvantageSettings`). This module is
the one place that maps the first onto the second, field by field under the same names, so a field
added to either side without the other fails here (and in tests/rl/test_rl_settings.py), not in a run.

Group sizes are not settings: the trainer passes each batch's groups (a prompt's completions,
`gconfig.n_samples` of them) to `grpo_advantages`. AReaL's copies of that number,
`actor.group_size` and `NormConfig.group_size`, are only checked against `gconfig.n_samples` at
load time (`laden.config.validate`), and dropped here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from laden.config.loader import yaml_scalar
from laden.config.ppo_settings import PPOSettings, ppo_settings_of
from laden.config.schema import LadenConfig, NormConfig
from laden.rl.advantages import AdvantageSettings, NormSettings
from laden.rl.critic import ValueSettings
from laden.rl.objectives import DistillSettings

NOT_YET_IMPLEMENTED: tuple[tuple[str, str], ...] = ()
"""(dotted field, why it has no effect) for fields that `laden rl` parses but does not implement yet;
remove an entry when the trainer implements its field."""

READ_WITH_A_CRITIC: tuple[tuple[str, str], ...] = (
    ("actor.discount", "every token's return is its completion's reward (discount 1)"),
    ("actor.gae_lambda", "the advantage is the completion's shaped, normalised reward (lambda 1)"),
)
"""(dotted field, what happens instead) for the GAE fields, which only a `critic` gives a meaning
in laden (AReaL runs GAE on zero values without a critic, discounting the reward over the tokens)."""


def ppo_settings(cfg: LadenConfig) -> PPOSettings:
    """The PPO-family loss of `cfg.actor` (every `PPOSettings` field has an `actor.*` field of that name)."""
    return ppo_settings_of(cfg.actor)


def distill_settings(cfg: LadenConfig) -> DistillSettings | None:
    """The teacher term of the actor's loss (`teacher.rl_loss_weight`, `distill_loss_weight`); None without one."""
    if cfg.teacher is None:
        return None
    return DistillSettings(**_same_names(DistillSettings, cfg.teacher))


def value_settings(cfg: LadenConfig) -> ValueSettings:
    """The critic's value loss (every `ValueSettings` field has a `critic.*` field of that name)."""
    assert cfg.critic is not None, "value_settings needs a critic section"
    return ValueSettings(**_same_names(ValueSettings, cfg.critic))


def norm_settings(norm: NormConfig | None) -> NormSettings | None:
    """`NormConfig` -> `NormSettings` (None stays None); `group_size` is dropped (see the module docstring)."""
    if norm is None:
        return None
    return NormSettings(**_same_names(NormSettings, norm))


def advantage_settings(cfg: LadenConfig) -> AdvantageSettings:
    """Reward shaping and normalisation of `cfg.actor`, for `grpo_advantages`."""
    return AdvantageSettings(
        **_same_names(AdvantageSettings, cfg.actor, skip=("reward_norm", "adv_norm")),
        reward_norm=norm_settings(cfg.actor.reward_norm),
        adv_norm=norm_settings(cfg.actor.adv_norm),
    )


def check_rl_fields_implemented(cfg: LadenConfig) -> list[str]:
    """One warning line per field of `NOT_YET_IMPLEMENTED` that `cfg` sets away from its default, and
    per field of `READ_WITH_A_CRITIC` set so without a critic."""
    defaults = LadenConfig()
    lines = []
    for dotted, why in NOT_YET_IMPLEMENTED:
        value, default = _resolve(cfg, dotted), _resolve(defaults, dotted)
        if value != default:
            lines.append(
                f"{dotted}={yaml_scalar(value)} is ignored: `laden rl` does not implement it yet ({why}); "
                f"remove it or set {dotted}: {yaml_scalar(default)}"
            )
    for dotted, instead in READ_WITH_A_CRITIC if cfg.critic is None else ():
        value, default = _resolve(cfg, dotted), _resolve(defaults, dotted)
        if value != default:
            lines.append(
                f"{dotted}={yaml_scalar(value)} is ignored without a critic: {instead}; add a critic section "
                f"(`critic: {{}}` trains a value model on the actor's settings) for GAE advantages, or set "
                f"{dotted}: {yaml_scalar(default)}"
            )
    return lines


def _same_names(settings_cls: type, source: object, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """`{name: source.name}` for every field of `settings_cls` not in `skip`."""
    names = [f.name for f in dataclasses.fields(settings_cls) if f.name not in skip]
    return {name: getattr(source, name) for name in names}


def _resolve(cfg: LadenConfig, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node
