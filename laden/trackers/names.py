"""Metric names for the trackers: AReaL's, for what laden logs that AReaL logs too.

metrics.jsonl keeps laden's names (the aliases, kept for one release; `laden.plots` and the tests read
them); the trackers get AReaL's, so a dashboard built for AReaL's runs reads laden's. A quantity AReaL
does not log keeps its laden name in the trackers too. docs/metrics.md is the table, with how each
pair differs where it does (a test checks that it lists every name here).

AReaL's names come from its stats tracker: a scope (`ppo_actor`, `ppo_actor/update`, `ppo_critic`,
`sft`, `sft-eval`, `eval-rollout`, `timeperf`), the quantity, and `/avg` for a token or sequence mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["AREAL_NAMES", "tracker_row"]

_SFT = {
    "loss": "sft/loss/avg",
    "grad_norm": "sft/grad_norm",
    "lr": "sft/lr",
    "num_tokens": "sft/n_tokens",
    "eval_loss": "sft-eval/loss/avg",
}
_RL = {
    "reward_mean": "ppo_actor/task_reward/avg",
    "completions": "ppo_actor/n_seqs",
    "num_loss_tokens": "ppo_actor/n_valid_tokens",
    "loss": "ppo_actor/update/actor_loss/avg",
    "grad_norm": "ppo_actor/update/grad_norm",
    "lr": "ppo_actor/update/lr",
    "clip_fraction": "ppo_actor/update/clip_ratio/avg",
    "dual_clip_fraction": "ppo_actor/update/dual_clip_ratio/avg",
    "approx_kl": "ppo_actor/update/approx_kl/avg",
    "importance_weight": "ppo_actor/update/importance_weight/avg",
    "entropy": "ppo_actor/update/entropy/avg",
    "critic_loss": "ppo_critic/critic_loss/avg",
    "critic_grad_norm": "ppo_critic/grad_norm",
    "critic_lr": "ppo_critic/lr",
    "value_clip_fraction": "ppo_critic/clip_ratio/avg",
    "value_mean": "ppo_critic/old_value/avg",
    "return_mean": "ppo_critic/target_value/avg",
    "eval/reward_mean": "eval-rollout/reward",
    "wait_s": "timeperf/rollout",
    "train_s": "timeperf/train_step",
    "update_s": "timeperf/update_weights",
    "eval/time_s": "timeperf/eval",
    "rkl_loss": "ppo_actor/update/rkl_loss/avg",
    "behav_imp_weight": "ppo_actor/update/behave_imp_weight/avg",
    "behave_approx_kl": "ppo_actor/update/behave_approx_kl/avg",
    "rs_filtered_fraction": "ppo_actor/update/rs_filtered_fraction",
    "sapo_soft_gate": "ppo_actor/update/sapo_soft_gate/avg",
    "sapo_scaled_gate_pos": "ppo_actor/update/sapo_scaled_gate_pos/avg",
    "sapo_scaled_gate_neg": "ppo_actor/update/sapo_scaled_gate_neg/avg",
    "teacher_logp_s": "timeperf/teacher_logp",
}


def _pairs(scope: str, names: dict[str, str]) -> dict[str, str]:
    """A pair job's names: the per-pair means under `scope/` (training) and `scope-eval/` (evaluation)."""
    out = {"grad_norm": f"{scope}/grad_norm", "lr": f"{scope}/lr", "num_tokens": f"{scope}/n_tokens"}
    for laden, areal in names.items():
        out[laden] = f"{scope}/{areal}/avg"
        out[f"eval/{laden}"] = f"{scope}-eval/{areal}/avg"
    return out


_DPO = _pairs("dpo", {"loss": "loss", "accuracy": "reward_accuracy", "margin": "reward_margin",
                      "chosen_reward": "chosen_reward", "rejected_reward": "rejected_reward"})  # fmt: skip
_RW = _pairs("rw", {"loss": "loss", "accuracy": "correct_ratio", "chosen_score": "pos_score",
                    "rejected_score": "neg_score"})  # fmt: skip
AREAL_NAMES: dict[str, dict[str, str]] = {"sft": _SFT, "rl": _RL, "dpo": _DPO, "rw": _RW}
"""Per job: laden's metrics.jsonl name -> AReaL's name."""


def tracker_row(row: Mapping[str, Any], job: str) -> dict[str, float]:
    """A metrics.jsonl row as the trackers get it: numbers only (no `step`, no per-rank lists), AReaL's
    names where AReaL has the quantity, laden's elsewhere."""
    names = AREAL_NAMES[job]
    return {
        names.get(key, key): float(value)
        for key, value in row.items()
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
    }
