"""PPO's advantages with a critic: GAE over each completion's tokens, in AReaL's order of operations.

With a value model (`critic`), a completion of C tokens is an episode of C actions: the state
before token t is the prompt and the tokens before it, and the critic's value V_t estimates the
return from there. The trainer computes, per completion:

1. its scalar reward shaped as for GRPO (`shaped_rewards`: the overlong penalty, bias, scaling,
   clip, `reward_norm` and `mask_no_eos_with_zero` of `grpo_advantages`, without `adv_norm`),
   given at its last token; every other token's reward is 0;
2. V_0..V_{C-1} from the critic (`laden.rl.critic`) and V_C = 0: the end of a completion is
   terminal whether it ended with EOS or was truncated, as verl, OpenRLHF and TRL count it
   (bootstrapping a truncated one from the critic's own value after its last token lets the values
   drift upward at discount 1); `gae` itself takes any V_C;
3. `gae`: delta_t = r_t + gamma V_{t+1} - V_t and A_t = sum_k (gamma lambda)^k delta_{t+k}
   (`actor.discount`, `actor.gae_lambda`), and the returns R_t = A_t + V_t, the value loss's
   targets (taken before normalisation);
4. `normalize_tokens`: `actor.adv_norm` with every token of the batch (or of its prompt's group)
   counted once, as AReaL normalises over its loss mask; a leave-one-out mean leaves out the token.

One deliberate difference from AReaL: `actor.kl_ctl` stays a loss term on the current log-probs
(`laden.rl.objectives`) with a critic too, where AReaL adds -kl_ctl * KL per token to the rewards
of step 1; one field keeps one meaning whether or not a critic is trained.

The recursion runs backwards over time on padded `[N, C_max]` float64 tensors (C_max vector steps
of width N, not N * C Python steps); everything here is host-side and off the training hot path.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import torch

from laden.rl.advantages import AdvantageSettings, NormSettings, check_group_sizes, grpo_advantages, normalize


def shaped_rewards(
    rewards: torch.Tensor | Sequence[float],
    settings: AdvantageSettings,
    *,
    group_sizes: Sequence[int],
    completion_lengths: Sequence[int] | None = None,
    has_eos: Sequence[bool] | None = None,
    max_new_tokens: int | None = None,
) -> torch.Tensor:
    """Step 1: one reward per completion, `[N]` fp32, shaped as `grpo_advantages` shapes it, without `adv_norm`."""
    return grpo_advantages(
        rewards, dataclasses.replace(settings, adv_norm=None), group_sizes=group_sizes,
        completion_lengths=completion_lengths, has_eos=has_eos, max_new_tokens=max_new_tokens,
    )  # fmt: skip


def gae(
    rewards: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    *,
    discount: float,
    gae_lambda: float,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Generalised advantage estimates and returns, `([C_i] fp32, [C_i] fp32)` per completion i.

    rewards: per completion, one reward per token `[C_i]`; values: per completion `[C_i + 1]`, the
    critic's V_0..V_{C_i}, the last one the bootstrap after the final token (0 for a terminal state).
    """
    if not (0 <= discount <= 1 and 0 <= gae_lambda <= 1):
        raise ValueError(
            f"actor.discount={discount} and actor.gae_lambda={gae_lambda} must be in [0, 1]; use 1.0 and 0.95 for "
            "example"
        )
    lengths = [int(r.numel()) for r in rewards]
    if len(values) != len(lengths) or any(v.numel() != c + 1 for v, c in zip(values, lengths)):
        raise ValueError(
            f"values must hold one more entry per completion than its rewards (the bootstrap value); rewards "
            f"have {lengths} tokens, values {[int(v.numel()) for v in values]}"
        )
    n, width = len(lengths), max(lengths, default=0)
    r = torch.zeros(n, width, dtype=torch.float64)  # [N, W]
    v = torch.zeros(n, width + 1, dtype=torch.float64)  # [N, W + 1]
    mask = torch.zeros(n, width + 1, dtype=torch.bool)  # [N, W + 1], the real tokens
    for i, (ri, vi, c) in enumerate(zip(rewards, values, lengths)):
        r[i, :c], v[i, : c + 1], mask[i, :c] = ri.double(), vi.double(), True
    if not (torch.isfinite(r).all() and torch.isfinite(v).all()):  # host tensors: validation
        raise ValueError("rewards and values must be finite; check the reward function and the critic's loss")
    delta = r + discount * v[:, 1:] - v[:, :-1]  # [N, W]
    adv = torch.zeros(n, width + 1, dtype=torch.float64)  # adv[:, C_i] = 0 ends each recursion
    decay = discount * gae_lambda
    for t in reversed(range(width)):
        adv[:, t] = torch.where(mask[:, t], delta[:, t] + decay * adv[:, t + 1], 0.0)
    returns = adv[:, :width] + v[:, :width]
    return (
        [adv[i, :c].float() for i, c in enumerate(lengths)],
        [returns[i, :c].float() for i, c in enumerate(lengths)],
    )


def last_token_rewards(rewards: torch.Tensor | Sequence[float], lengths: Sequence[int]) -> list[torch.Tensor]:
    """Step 1's per-token rewards: each completion's reward at its last token, 0 elsewhere (`[C_i]` fp32)."""
    values = torch.as_tensor(rewards, dtype=torch.float32)
    out = []
    for reward, c in zip(values, lengths):
        tokens = torch.zeros(int(c), dtype=torch.float32)
        if c:
            tokens[-1] = reward
        out.append(tokens)
    return out


def normalize_tokens(
    advantages: Sequence[torch.Tensor], settings: NormSettings | None, *, group_sizes: Sequence[int]
) -> list[torch.Tensor]:
    """Step 4: `settings` over every token of the batch or of each group (`[C_i]` fp32 per completion).

    advantages: per completion, grouped by prompt in order; group_sizes: completions per prompt.
    None leaves them as they are.
    """
    if settings is None:
        return [a.float() for a in advantages]
    sizes = check_group_sizes(group_sizes, len(advantages))
    lengths = [int(a.numel()) for a in advantages]
    if sum(lengths) == 0:
        return [a.float() for a in advantages]
    starts = [0, *itertools.accumulate(sizes)]
    tokens = [sum(lengths[a:b]) for a, b in zip(starts, starts[1:])]
    flat = torch.cat([a.double() for a in advantages])
    out = normalize(
        flat, settings, group_sizes=[t for t in tokens if t > 0] if settings.uses_groups else None
    )
    return list(out.split(lengths))


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over tokens: 1 for a perfect critic, 0 for a constant one (nan without spread)."""
    var = returns.double().var(unbiased=False)
    if returns.numel() == 0 or not var > 0:
        return math.nan
    return float(1 - (returns.double() - values.double()).var(unbiased=False) / var)
