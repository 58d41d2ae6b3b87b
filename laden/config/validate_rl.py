"""Validation of the RL settings: generation, the reward and workflow import paths, the PPO loss, groups.

Errors for settings that contradict each other (a sequence-level ratio with context parallelism,
an AReaL group size other than `gconfig.n_samples`, an overlong penalty without its budget); a
`UserWarning` for settings that are legal but ignored or known to hurt (an actor temperature
other than the sampling one, group normalisation over groups of one). Import paths are checked
for their form only; nothing is imported here.
"""

from __future__ import annotations

import math
import warnings

from laden.config.schema import LadenConfig
from laden.config.validate_alloc import parse_or_none
from laden.import_path import import_path_error

__all__ = [
    "generation_errors",
    "import_path_errors",
    "ppo_errors",
    "rl_errors",
    "warn_ppo",
    "warn_rewards",
]


def generation_errors(cfg: LadenConfig) -> list[str]:
    errors = []
    for name, g in (("gconfig", cfg.gconfig), ("eval_gconfig", cfg.eval_gconfig)):
        if g is None:
            continue
        if g.min_new_tokens > g.max_new_tokens:
            errors.append(
                f"{name}.min_new_tokens={g.min_new_tokens} is larger than {name}.max_new_tokens="
                f"{g.max_new_tokens}; set it to at most {g.max_new_tokens}"
            )
        if g.temperature == 0 and not g.greedy:
            errors.append(
                f"{name}.temperature=0.0 cannot be sampled from; set {name}.greedy: true for greedy "
                "decoding or a temperature > 0"
            )
    return errors


def import_path_errors(cfg: LadenConfig) -> list[str]:
    """`reward_fn` and `workflow` name an object as `module:name` (or `module.name`); nothing is imported here."""
    errors = []
    for dotted, value, example in (
        ("reward_fn", cfg.reward_fn, "reward_fn=laden.rl.rewards:math_reward"),
        ("workflow", cfg.workflow, "workflow=laden.rl.workflow:RLVRWorkflow"),
        *(
            (f"reward_fns[{i}].fn", spec.fn, "laden.rl.rewards:math_reward")
            for i, spec in enumerate(cfg.reward_fns)
        ),
    ):
        error = import_path_error(value, field=dotted, fix=f"write `module:name`, e.g. {example}")
        if error:
            errors.append(error)
    for i, spec in enumerate(cfg.reward_fns):
        if not math.isfinite(spec.weight):
            errors.append(
                f"reward_fns[{i}].weight={spec.weight!r} must be a finite number; set it to e.g. 1.0"
            )
    return errors


def warn_rewards(cfg: LadenConfig) -> None:
    default = LadenConfig()
    changed = [f for f in ("reward_fn", "reward_fn_style") if getattr(cfg, f) != getattr(default, f)]
    if cfg.reward_fns and changed:
        warnings.warn(
            f"{', '.join(f'{f}={getattr(cfg, f)!r}' for f in changed)} ignored: reward_fns is set and names every "
            "reward function with its own style; add it to reward_fns, or remove reward_fns",
            UserWarning,
            stacklevel=3,
        )


def ppo_errors(cfg: LadenConfig) -> list[str]:
    """Fields of the PPO loss and reward shaping that only make sense together."""
    from laden.config.ppo_settings import SettingsError, ppo_settings_of  # torch-free

    a = cfg.actor
    errors = []
    try:
        ppo_settings_of(a)
    except SettingsError as e:  # the loss's own rules (decoupled loss, rejection sampling, M2PO, SAPO)
        errors += e.errors
    except (TypeError, ValueError):
        pass  # a value of the wrong type: the loader and the range checks report it
    if a.overlong_reward_penalty:
        if a.overlong_tokens is None:
            errors.append(
                "actor.overlong_tokens=null is required by actor.overlong_reward_penalty=true (the penalised "
                "tail of the generation budget); set it to a token count, e.g. actor.overlong_tokens: 256"
            )
        if a.overlong_penalty_factor is None:
            errors.append(
                "actor.overlong_penalty_factor=null is required by actor.overlong_reward_penalty=true (the "
                "penalty at gconfig.max_new_tokens); set it, e.g. actor.overlong_penalty_factor: 1.0"
            )
    return errors


def rl_errors(cfg: LadenConfig) -> list[str]:
    """RL rules that involve the generation settings or the actor's parallelism."""
    return (
        _sequence_level_errors(cfg) + _group_errors(cfg) + _overlong_budget_errors(cfg) + _teacher_errors(cfg)
    )


def _teacher_errors(cfg: LadenConfig) -> list[str]:
    """A teacher needs a model, and a loss with something in it."""
    t = cfg.teacher
    if t is None:
        return []
    errors = []
    if not t.path:
        errors.append(
            "teacher.path='': the teacher section needs the teacher model; set teacher.path to a Hugging Face "
            "model directory or Hub id whose tokenizer gives the actor's tokens the actor's ids, or set teacher: null"
        )
    if t.rl_loss_weight == 0 and t.distill_loss_weight == 0:
        errors.append(
            "teacher.rl_loss_weight=0 and teacher.distill_loss_weight=0: the actor's loss would be 0; set "
            "distill_loss_weight > 0 (e.g. 0.005, AReaL's default), or remove the teacher section"
        )
    return errors


def _sequence_level_errors(cfg: LadenConfig) -> list[str]:
    """Sequence-level ratios and averages need whole sequences; context parallelism slices them."""
    mode = parse_or_none(cfg.actor.backend)
    if mode is None or mode.cp <= 1:
        return []
    a, errors = cfg.actor, []
    split = f"actor.backend={a.backend!r} splits every sequence over c={mode.cp} context-parallel ranks"
    if a.importance_sampling_level == "sequence":
        errors.append(
            f"actor.importance_sampling_level='sequence' needs whole sequences, but {split}; train with c=1 "
            "in actor.backend, or set actor.importance_sampling_level: token"
        )
    if a.loss_agg_mode == "seq-mean-token-mean":
        errors.append(
            f"actor.loss_agg_mode='seq-mean-token-mean' needs whole sequences, but {split}; train with c=1 "
            "in actor.backend, or set actor.loss_agg_mode: token-mean"
        )
    if a.rejection_sampling is not None and a.rejection_sampling.level == "sequence":
        errors.append(
            f"actor.rejection_sampling.level='sequence' needs whole sequences, but {split}; train with c=1 "
            "in actor.backend, or set actor.rejection_sampling.level: token"
        )
    if a.m2_threshold is not None:
        errors.append(
            f"actor.m2_threshold={a.m2_threshold} selects tokens over each micro-batch (AReaL's M2PO), but "
            f"{split}, so each rank would select over its slice; train with c=1 in actor.backend, or set "
            "actor.m2_threshold: null"
        )
    return errors


def _group_errors(cfg: LadenConfig) -> list[str]:
    """laden's groups are each prompt's `gconfig.n_samples` completions; AReaL's copies of it must agree."""
    n, a = cfg.gconfig.n_samples, cfg.actor
    errors = []
    sizes = {"actor.group_size": a.group_size}
    for name in ("reward_norm", "adv_norm"):
        norm = getattr(a, name)
        if norm is not None:
            sizes[f"actor.{name}.group_size"] = norm.group_size
    for dotted, size in sizes.items():
        if size >= 1 and size not in (1, n):  # sizes < 1 are range errors
            errors.append(
                f"{dotted}={size} does not match gconfig.n_samples={n}: a group is one prompt's completions; "
                f"set gconfig.n_samples: {size} (AReaL writes {dotted.rsplit('.', 1)[-1]}: "
                f"${{gconfig.n_samples}}), or {dotted}: {n}"
            )
    if a.dynamic_sampling and n == 1:
        errors.append(
            "actor.dynamic_sampling=true with gconfig.n_samples=1 drops every group (the rewards of a group "
            "of one are all equal); set gconfig.n_samples to 2 or more, or actor.dynamic_sampling: false"
        )
    return errors


def _overlong_budget_errors(cfg: LadenConfig) -> list[str]:
    tokens, budget = cfg.actor.overlong_tokens, cfg.gconfig.max_new_tokens
    if not cfg.actor.overlong_reward_penalty or tokens is None or tokens <= budget:
        return []
    return [
        f"actor.overlong_tokens={tokens} is larger than gconfig.max_new_tokens={budget}, the generation "
        f"budget whose tail it penalises; set it to at most {budget}"
    ]


def warn_ppo(cfg: LadenConfig, *, rl: bool) -> None:
    """RL settings that are legal but ignored or known to hurt (sft names them via `usage`)."""
    if not rl:
        return
    a, g = cfg.actor, cfg.gconfig
    ignored = [f for f in ("overlong_tokens", "overlong_penalty_factor") if getattr(a, f) is not None]
    if ignored and not a.overlong_reward_penalty:
        warnings.warn(
            f"actor.{{{', '.join(ignored)}}} are ignored because actor.overlong_reward_penalty=false; set it "
            "to true to penalise overlong completions, or remove them",
            UserWarning,
            stacklevel=3,
        )
    if not g.greedy and a.temperature != g.temperature and a.temperature > 0:
        warnings.warn(
            f"actor.temperature={a.temperature} differs from gconfig.temperature={g.temperature}: the trainer's "
            "log-probs are then of another distribution than the one sampled, which biases every importance "
            f"ratio; set actor.temperature: {g.temperature}",
            UserWarning,
            stacklevel=3,
        )
    grouped = [
        f"actor.{name}"
        for name in ("reward_norm", "adv_norm")
        if getattr(a, name) is not None and getattr(a, name).mean_level == "group"
    ]
    if grouped and g.n_samples == 1:
        verb = "subtract" if len(grouped) > 1 else "subtracts"
        warnings.warn(
            f"{' and '.join(grouped)} {verb} each group's mean, but gconfig.n_samples=1 makes every group one "
            "completion, so every advantage is 0 and nothing is learned; set gconfig.n_samples to 2 or more "
            "(GRPO), or mean_level: batch",
            UserWarning,
            stacklevel=3,
        )
