"""GRPO-style advantages from per-completion rewards grouped by prompt, with AReaL's reward shaping.

A prompt's `n` completions form a group; each completion gets one scalar reward, and GRPO's
advantage is that reward normalised within its group (every token of the completion then
carries it: `pack_samples(..., fields={"advantages": ...})`). `grpo_advantages` runs AReaL's
order of operations (`actor.*` names):

1. `overlong_reward_penalty`: DAPO's soft length penalty, linear from 0 at
   `max_new_tokens - overlong_tokens` generated tokens to `-overlong_penalty_factor` at
   `max_new_tokens` (and beyond), added to the reward;
2. `(reward + reward_bias) * reward_scaling`, clipped to `[-reward_clip, reward_clip]`;
3. `reward_norm` (`NormSettings`): centre and scale per group (`GRPO_NORM`) or over the batch;
4. `mask_no_eos_with_zero`: truncated completions (no EOS) get 0;
5. `adv_norm` (`NormSettings`): a second normalisation. AReaL runs it over tokens, so a
   completion weighs its number of tokens: pass `completion_lengths` to get exactly that.

`GRPO_NORM` is the group mean and standard deviation; `DR_GRPO_NORM` the group mean only
(Dr. GRPO: no division by the std, which up-weights groups of nearly equal rewards). A group
whose rewards are all equal normalises to zeros (its centred rewards are 0; `eps` keeps the
division finite); `dynamic_sampling_filter` (DAPO's dynamic sampling, `actor.dynamic_sampling`)
drops such groups, since they carry no gradient.

Everything here is a host-side function of small per-completion tensors (one value per
completion, not per token), computed in float64 and returned as float32; none of it is on the
training hot path, so host syncs (`tolist`) are allowed where validation needs them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

NormLevel = Literal["batch", "group"]
_LEVELS = ("batch", "group", None)


@dataclass(frozen=True, kw_only=True, slots=True)
class NormSettings:
    """Centre and scale per-completion values (AReaL's `NormConfig`: `actor.reward_norm`, `actor.adv_norm`)."""

    mean_level: NormLevel | None = "batch"
    """Subtract the mean of the `batch`, of each `group`, or nothing (None)."""
    mean_leave1out: bool = False
    """Leave-one-out mean: each value's baseline is the mean of the others (RLOO); 0 when there is none."""
    std_level: NormLevel | None = "batch"
    """Divide by the standard deviation of the `batch`, of each `group`, or nothing (None: Dr. GRPO)."""
    std_unbiased: bool = True
    """Bessel's correction (divide by n - 1); a single value then has std 1."""
    eps: float = 1e-5
    """Added to the std before dividing, so zero-std groups give 0, not NaN."""

    def __post_init__(self) -> None:
        errors = []
        if self.mean_level not in _LEVELS:
            errors.append(f"mean_level={self.mean_level!r} is not known; use 'batch', 'group' or null")
        if self.std_level not in _LEVELS:
            errors.append(f"std_level={self.std_level!r} is not known; use 'batch', 'group' or null")
        if not (math.isfinite(self.eps) and self.eps >= 0):
            errors.append(f"eps={self.eps} must be a finite number >= 0 (it guards the division); use 1e-5")
        if errors:
            raise ValueError("invalid normalisation settings:\n  " + "\n  ".join(errors))

    @property
    def uses_groups(self) -> bool:
        """Whether normalising needs the group sizes."""
        return "group" in (self.mean_level, self.std_level)


GRPO_NORM = NormSettings(mean_level="group", std_level="group")
"""GRPO: each reward minus its group's mean, over the group's (unbiased) std."""
DR_GRPO_NORM = NormSettings(mean_level="group", std_level=None)
"""Dr. GRPO: each reward minus its group's mean, not scaled."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AdvantageSettings:
    """Reward shaping and normalisation before the update (AReaL's `actor.*` names and defaults)."""

    reward_scaling: float = 1.0
    """Multiplies the reward (after adding `reward_bias`)."""
    reward_bias: float = 0.0
    """Added to the reward before scaling."""
    reward_clip: float = 20.0
    """Largest absolute reward after bias and scaling; larger ones are clipped."""
    reward_norm: NormSettings | None = None
    """Normalisation of the shaped rewards (`GRPO_NORM`, `DR_GRPO_NORM`, ...); None = as they are."""
    adv_norm: NormSettings | None = None
    """Normalisation of the advantages, token-weighted given `completion_lengths`; None = off."""
    mask_no_eos_with_zero: bool = False
    """Truncated completions (no EOS) get advantage 0 before `adv_norm`."""
    overlong_reward_penalty: bool = False
    """DAPO's soft overlong penalty on the reward (needs the two fields below)."""
    overlong_tokens: int | None = None
    """Length of the penalised tail before `max_new_tokens`."""
    overlong_penalty_factor: float | None = None
    """Penalty at `max_new_tokens` generated tokens (and beyond)."""

    def __post_init__(self) -> None:
        errors = []
        if not math.isfinite(self.reward_scaling) or not math.isfinite(self.reward_bias):
            errors.append(
                f"actor.reward_scaling={self.reward_scaling} and actor.reward_bias={self.reward_bias} "
                "must be finite; use 1.0 and 0.0 to leave rewards as they are"
            )
        if not self.reward_clip > 0:
            errors.append(
                f"actor.reward_clip={self.reward_clip} must be > 0 (the largest |reward|); use 20.0"
            )
        if self.overlong_reward_penalty:
            if self.overlong_tokens is None or self.overlong_tokens < 1:
                errors.append(
                    f"actor.overlong_tokens={self.overlong_tokens} must be a positive token count with "
                    "actor.overlong_reward_penalty=true (the penalised tail); e.g. 256"
                )
            factor = self.overlong_penalty_factor
            if factor is None or not (math.isfinite(factor) and factor >= 0):
                errors.append(
                    f"actor.overlong_penalty_factor={factor} must be a finite number >= 0 with "
                    "actor.overlong_reward_penalty=true (the penalty at max_new_tokens); e.g. 1.0"
                )
        if errors:
            raise ValueError("invalid advantage settings:\n  " + "\n  ".join(errors))


def check_group_sizes(group_sizes: Sequence[int], num_completions: int) -> list[int]:
    """`group_sizes` as a list, after checking that they are positive and cover `num_completions`."""
    sizes = [int(s) for s in group_sizes]
    if any(s < 1 for s in sizes) or sum(sizes) != num_completions:
        raise ValueError(
            f"group_sizes={sizes} must be positive and sum to the number of completions "
            f"({num_completions}); pass one entry per prompt, its number of completions, in order"
        )
    return sizes


def _vector(name: str, values: torch.Tensor | Sequence[float]) -> torch.Tensor:
    x = torch.as_tensor(values, dtype=torch.float64)
    if x.dim() != 1:
        raise ValueError(f"{name} must be one value per completion ([N]); got shape {tuple(x.shape)}")
    if not torch.isfinite(x).all():  # host tensors: validation, not a hot path
        raise ValueError(f"{name} has non-finite values; check the reward function's outputs")
    return x


def _segment_index(level: NormLevel, sizes: list[int] | None, n: int) -> tuple[torch.Tensor, int]:
    """([N] segment of each completion, number of segments): one for the batch, one per group."""
    if level == "batch":
        return torch.zeros(n, dtype=torch.long), 1
    assert sizes is not None
    return torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes)), len(sizes)


def _segment_sum(x: torch.Tensor, index: torch.Tensor, count: int) -> torch.Tensor:
    """Each element's segment total, [N]."""
    return x.new_zeros(count).index_add_(0, index, x)[index]


def _mean(x: torch.Tensor, w: torch.Tensor, settings: NormSettings, sizes: list[int] | None) -> torch.Tensor:
    if settings.mean_level is None:
        return torch.zeros_like(x)
    index, count = _segment_index(settings.mean_level, sizes, x.numel())
    total, weight = _segment_sum(w * x, index, count), _segment_sum(w, index, count)
    if settings.mean_leave1out:
        others = weight - w
        return torch.where(others > 0, (total - w * x) / others.clamp(min=1e-300), x)
    return torch.where(weight > 0, total / weight.clamp(min=1e-300), torch.zeros_like(x))


def _std(
    x: torch.Tensor, mean: torch.Tensor, w: torch.Tensor, settings: NormSettings, sizes: list[int] | None
) -> torch.Tensor:
    assert settings.std_level is not None
    index, count = _segment_index(settings.std_level, sizes, x.numel())
    squares, weight = _segment_sum(w * (x - mean) ** 2, index, count), _segment_sum(w, index, count)
    dof = weight - 1 if settings.std_unbiased else weight
    return torch.where(dof > 0, (squares / dof.clamp(min=1e-300)).sqrt(), torch.ones_like(x))


def normalize(
    values: torch.Tensor | Sequence[float],
    settings: NormSettings,
    *,
    group_sizes: Sequence[int] | None = None,
    weights: torch.Tensor | Sequence[float] | None = None,
) -> torch.Tensor:
    """`(values - mean) / (std + eps)` at the configured levels, `[N]` fp32.

    values: one per completion, grouped by prompt in order; group_sizes: completions per prompt
    (needed when a level is `group`). weights: optional non-negative counts per completion, as
    if completion i appeared `weights[i]` times (its token count: AReaL's token-level `adv_norm`
    with every token of a completion carrying the same value); leave-one-out leaves out the
    whole completion. The std is taken around the mean actually subtracted (the leave-one-out
    one included); with Bessel's correction a segment of weight <= 1 has std 1.
    """
    return _normalized(_vector("values", values), settings, group_sizes, weights).float()


def _normalized(
    x: torch.Tensor,
    settings: NormSettings,
    group_sizes: Sequence[int] | None,
    weights: torch.Tensor | Sequence[float] | None,
) -> torch.Tensor:
    """`normalize` on a float64 vector, float64 out."""
    sizes = None
    if settings.uses_groups:
        if group_sizes is None:
            raise ValueError("a 'group' normalisation level needs group_sizes (completions per prompt)")
        sizes = check_group_sizes(group_sizes, x.numel())
    w = torch.ones_like(x) if weights is None else _vector("weights", weights)
    if w.shape != x.shape or (w < 0).any():
        raise ValueError(
            f"weights must be [N] = [{x.numel()}] non-negative counts (e.g. tokens per completion); got "
            f"shape {tuple(w.shape)}, minimum {w.min().item() if w.numel() else None}"
        )
    mean = _mean(x, w, settings, sizes)
    if settings.std_level is None:
        return x - mean
    return (x - mean) / (_std(x, mean, w, settings, sizes) + settings.eps)


def shape_rewards(
    rewards: torch.Tensor | Sequence[float], *, reward_bias: float, reward_scaling: float, reward_clip: float
) -> torch.Tensor:
    """`clip((rewards + reward_bias) * reward_scaling, -reward_clip, reward_clip)`, `[N]` fp32."""
    return _shaped(_vector("rewards", rewards), reward_bias, reward_scaling, reward_clip).float()


def _shaped(x: torch.Tensor, bias: float, scaling: float, clip: float) -> torch.Tensor:
    return ((x + bias) * scaling).clamp(-clip, clip)


def overlong_penalty(
    completion_lengths: torch.Tensor | Sequence[int],
    *,
    max_new_tokens: int,
    overlong_tokens: int,
    overlong_penalty_factor: float,
) -> torch.Tensor:
    """DAPO's soft overlong penalty per completion, `[N]` fp32, to add to the rewards.

    0 up to `max_new_tokens - overlong_tokens` generated tokens, then linear down to
    `-overlong_penalty_factor` at `max_new_tokens`, and that value beyond it.
    """
    lengths = _vector("completion_lengths", completion_lengths)
    return _penalty(lengths, max_new_tokens, overlong_tokens, overlong_penalty_factor).float()


def _penalty(lengths: torch.Tensor, max_new_tokens: int, overlong_tokens: int, factor: float) -> torch.Tensor:
    if not 1 <= overlong_tokens <= max_new_tokens:
        raise ValueError(
            f"overlong_tokens={overlong_tokens} must be in [1, max_new_tokens={max_new_tokens}]: it is "
            "the penalised tail of the generation budget; lower actor.overlong_tokens"
        )
    excess = lengths - (max_new_tokens - overlong_tokens)  # tokens into the penalised tail
    return (-excess / overlong_tokens * factor).clamp(-factor, 0.0)


def mask_no_eos_with_zero(
    values: torch.Tensor | Sequence[float], has_eos: torch.Tensor | Sequence[bool]
) -> torch.Tensor:
    """`values` with 0 for completions that ended without EOS (truncated), `[N]` fp32."""
    return _masked_no_eos(_vector("values", values), has_eos).float()


def _masked_no_eos(x: torch.Tensor, has_eos: torch.Tensor | Sequence[bool]) -> torch.Tensor:
    eos = torch.as_tensor(has_eos, dtype=torch.bool)
    if eos.shape != x.shape:
        raise ValueError(f"has_eos must be one flag per completion ([{x.numel()}]); got {tuple(eos.shape)}")
    return torch.where(eos, x, torch.zeros_like(x))


def dynamic_sampling_filter(
    rewards: torch.Tensor | Sequence[float], group_sizes: Sequence[int]
) -> tuple[torch.Tensor, list[int]]:
    """DAPO's dynamic sampling: `(keep [N] bool, sizes of the kept groups)`.

    A group whose rewards are all equal (all solved, all failed) normalises to zero advantages
    and carries no gradient, so its completions are dropped. The batch shrinks accordingly.
    """
    x = _vector("rewards", rewards)
    sizes = check_group_sizes(group_sizes, x.numel())
    keep_group = [bool(g.max() > g.min()) for g in x.split(sizes)]
    keep = torch.repeat_interleave(torch.tensor(keep_group, dtype=torch.bool), torch.tensor(sizes))
    return keep, [s for s, k in zip(sizes, keep_group) if k]


def grpo_advantages(
    rewards: torch.Tensor | Sequence[float],
    settings: AdvantageSettings,
    *,
    group_sizes: Sequence[int],
    completion_lengths: torch.Tensor | Sequence[int] | None = None,
    has_eos: torch.Tensor | Sequence[bool] | None = None,
    max_new_tokens: int | None = None,
) -> torch.Tensor:
    """One advantage per completion, `[N]` fp32, in AReaL's order (see the module docstring).

    rewards: one per completion, grouped by prompt in order; group_sizes: completions per prompt.
    completion_lengths: generated tokens per completion (the overlong penalty; token-weights
    `adv_norm`); has_eos: whether each completion ended with EOS (`mask_no_eos_with_zero`);
    max_new_tokens: the generation budget (`gconfig.max_new_tokens`, the overlong penalty).
    """
    x = _vector("rewards", rewards)
    sizes = check_group_sizes(group_sizes, x.numel())
    if settings.overlong_reward_penalty:
        if completion_lengths is None or max_new_tokens is None:
            raise ValueError(
                "actor.overlong_reward_penalty=true needs completion_lengths and max_new_tokens; pass "
                "them or set actor.overlong_reward_penalty=false"
            )
        assert settings.overlong_tokens is not None and settings.overlong_penalty_factor is not None
        lengths = _vector("completion_lengths", completion_lengths)
        x = x + _penalty(lengths, max_new_tokens, settings.overlong_tokens, settings.overlong_penalty_factor)
    x = _shaped(x, settings.reward_bias, settings.reward_scaling, settings.reward_clip)
    if settings.reward_norm is not None:
        x = _normalized(x, settings.reward_norm, sizes, None)
    if settings.mask_no_eos_with_zero:
        if has_eos is None:
            raise ValueError(
                "actor.mask_no_eos_with_zero=true needs has_eos (one flag per completion); pass it or "
                "set actor.mask_no_eos_with_zero=false"
            )
        x = _masked_no_eos(x, has_eos)
    if settings.adv_norm is not None:
        x = _normalized(x, settings.adv_norm, sizes, completion_lengths)
    return x.float()
