"""RL-tuning: PPO-family objectives on the train engines, GRPO-style advantages, rewards.

Names are imported on first use, so a reward worker process that imports `laden.rl.rewards`
does not pay for torch."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    **dict.fromkeys(
        (
            "DR_GRPO_NORM", "GRPO_NORM", "AdvantageSettings", "NormSettings", "dynamic_sampling_filter",
            "grpo_advantages", "mask_no_eos_with_zero", "normalize", "overlong_penalty", "shape_rewards",
        ),
        "laden.rl.advantages",
    ),
    **dict.fromkeys(("PPOObjective", "PPOSettings", "kl_estimate"), "laden.rl.objectives"),
    **dict.fromkeys(
        ("RewardInfo", "RewardSetupError", "RewardSpec", "load_reward_fn", "missing_fields"),
        "laden.rl.reward_styles",
    ),
    **dict.fromkeys(("RewardOutcome", "RewardPool"), "laden.rl.reward_pool"),
    **dict.fromkeys(("math_reward", "reasoning_gym_reward"), "laden.rl.rewards"),
    **dict.fromkeys(("EvalResult", "eval_metrics", "eval_sampling", "evaluate"), "laden.rl.evaluate"),
    **dict.fromkeys(("run_eval",), "laden.rl.eval_job"),
}  # fmt: skip

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'laden.rl' has no attribute {name!r}")
