"""`laden rl`'s training on a batch of trajectories: advantages (GRPO's, or GAE on the critic's values),
packing into token-budget micro-batches with per-token advantages and log-probabilities, the PPO
minibatches, the recomputed log-probabilities and those of the reference model and the teacher
(`laden.rl.scoring`), and the re-split of a step that runs out of memory (`oom_policy: auto`)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from laden.data import PackedBatch
from laden.engine.runtime import OOMRetry, batch_device
from laden.rl.batches import pack_trajectories
from laden.rl.prox_approx import input_token_versions
from laden.rl.run_part import RunPart
from laden.rl.scoring import score, teacher_temperature

log = logging.getLogger("laden.rl")


class PolicyStep(RunPart):
    """The policy's training step of a `laden rl` run (a part of `laden.rl.trainer._Run`)."""

    def _train_on(self, groups: list[list[Any]], shares: list[Any]) -> dict[str, float]:
        """Advantages (over every rank's completions, `shares`), micro-batches, `ppo_n_minibatches`
        optimizer steps (then the critic's); metrics as floats."""
        cfg = self.cfg
        trajs = [t for g in groups for t in g]
        advantages, critic_targets, metrics = self._advantages(trajs, shares)
        fewest_groups = min(len(sizes) for _, sizes in shares)
        n = max(1, min(cfg.actor.ppo_n_minibatches, fewest_groups))
        chunks = [groups[i::n] for i in range(n)]
        # The trainer's log-probs (proximal / old; with recompute_logprob alone the old ones the ratio is
        # taken against), the reference's and the teacher's, all under the weights before this step's
        # first update: later minibatches' ratios then measure how far the policy moved.
        chunk_mbs = [self._micro_batches([t for g in chunk for t in g], advantages) for chunk in chunks]
        teacher_s = 0.0
        settings = self.objective.settings
        self.objective.version = self._step_now - 1  # the weights' version (the proximal approximation's)
        for mbs in chunk_mbs:  # AReaL's should_compute_prox_logp: not with prox_logp_method loglinear
            if settings.recomputes_prox or (not cfg.actor.use_decoupled_loss and cfg.actor.recompute_logprob):
                name = "prox_logprobs" if cfg.actor.use_decoupled_loss else "old_logprobs"
                score(self.engine, mbs, name, temperature=cfg.actor.temperature)
            if self.ref is not None:  # the KL term's reference
                score(self.ref, mbs, "ref_logprobs", temperature=cfg.actor.temperature)
            if self.teacher is not None:  # the distillation term's teacher
                t0 = time.perf_counter()
                score(self.teacher, mbs, "teacher_logprobs", temperature=teacher_temperature(cfg))
                teacher_s += time.perf_counter() - t0
        if self.teacher is not None:
            metrics["teacher_logp_s"] = round(teacher_s, 3)
        for mbs in chunk_mbs:
            normalizer = self._sum(self.objective.loss_normalizer(mbs))
            loss = self._forward_backward(mbs, max(normalizer, 1))
            step_out = self.engine.optimizer_step()
            stats = self._global_stats(self.objective.pop_stats(), mbs)
            values = {"loss": loss, **step_out, **stats}
            for name, value in values.items():
                metrics[name] = metrics.get(name, 0.0) + float(value) / len(chunks)
        if self.critic is not None:
            n = max(1, min(self.critic.section.ppo_n_minibatches, fewest_groups))
            critic_chunks = [[t for g in groups[i::n] for t in g] for i in range(n)]
            metrics.update(self.critic.update(critic_chunks, *critic_targets))
        return metrics

    def _global_stats(self, stats: dict[str, torch.Tensor], mbs: list[PackedBatch]) -> dict[str, float]:
        """The objective's token means over every rank's loss tokens, and the global `num_loss_tokens`.
        The loss runs where the model's last layers are (a pipeline's last stage, each context rank on
        its slice of the tokens, every tensor rank on all of them), so each rank's means are weighted by
        the loss tokens it saw; the processes of one data-parallel index repeat alike."""
        local = {name: float(v) for name, v in stats.items()}
        if self.rt.world_size == 1:
            return local
        everyone = [s for s in self._gather(local) if s]
        seen = sum(s["num_loss_tokens"] for s in everyone)
        out = {
            name: sum(s[name] * s["num_loss_tokens"] for s in everyone if name in s) / max(seen, 1.0)
            for name in dict.fromkeys(n for s in everyone for n in s)
        }
        out["num_loss_tokens"] = float(self._sum(sum(mb.num_loss_tokens for mb in mbs)))
        return out

    def _forward_backward(self, mbs: list[PackedBatch], normalizer: int) -> torch.Tensor:
        """The policy's gradients of `mbs`. Under `oom_policy: auto` in one process, a step that runs out of
        memory is made again on the same documents: each micro-batch split in two at a document boundary
        (`split_documents`), as often as it takes, then with layer recompute. `forward_backward` starts
        from fresh gradients and the loss is a sum over tokens, so the step is the one a run without the
        failure makes (up to the summation order). Otherwise, or when nothing is left to split, the error
        names the knob changes."""
        retry = OOMRetry(cfg=self.cfg, rt=self.rt, recompute=self.engine.enable_recompute)
        return retry.split_documents(
            mbs, lambda mbs: self.engine.forward_backward(mbs, self.objective, normalizer=normalizer),
            step=self._step_now, on_failure=self.objective.pop_stats,  # the failed attempt's partial statistics
        )  # fmt: skip

    def _advantages(
        self, trajs: list[Any], shares: list[Any]
    ) -> tuple[dict[int, list[float]], Any, dict[str, float]]:
        """(per-token advantages of this rank's completions by `id(traj)`, the critic's targets, metrics).

        Without a critic GRPO's: one value per completion, from every rank's rewards (`shares`). With
        one, GAE's (`laden.rl.gae`) on the critic's values, normalised over every rank's tokens; the
        targets are then `(old values, returns)` by `id(traj)`."""
        from laden.rl.advantages import grpo_advantages

        rows = [x for r, _ in shares for x in r]
        first = sum(len(r) for r, _ in shares[: self._dp_rank()])
        shaping: dict[str, Any] = dict(
            group_sizes=[n for _, sizes in shares for n in sizes], completion_lengths=[n for _, n, _ in rows],
            has_eos=[e for _, _, e in rows], max_new_tokens=self.cfg.gconfig.max_new_tokens,
        )  # fmt: skip
        if self.critic is None:
            adv_all = grpo_advantages([r for r, _, _ in rows], self.adv_settings, **shaping).tolist()
            adv = adv_all[first : first + len(trajs)]
            return {id(t): [a] * len(t.completion_ids) for t, a in zip(trajs, adv)}, None, {}
        from laden.rl.gae import explained_variance, gae, last_token_rewards, normalize_tokens, shaped_rewards

        rewards = shaped_rewards([r for r, _, _ in rows], self.adv_settings, **shaping)
        values = self.critic.values(trajs)  # [C + 1] each
        # The end of a completion is terminal, truncated or not (as verl, OpenRLHF and TRL count it):
        # bootstrapping a truncated one from the critic's own value lets the values drift upward.
        for v in values:
            v[-1] = 0.0
        raw, returns = gae(
            last_token_rewards(rewards[first : first + len(trajs)], [len(t.completion_ids) for t in trajs]), values,
            discount=self.cfg.actor.discount, gae_lambda=self.cfg.actor.gae_lambda,
        )  # fmt: skip
        everyone = [a for part in self._of_each_data_rank(raw) for a in part]
        adv = normalize_tokens(everyone, self.adv_settings.adv_norm, group_sizes=shaping["group_sizes"])
        old = [v[:-1] for v in values]
        flat_old, flat_returns = torch.cat([*old, torch.zeros(0)]), torch.cat([*returns, torch.zeros(0)])
        metrics = {
            "value_mean": float(flat_old.mean()) if flat_old.numel() else math.nan,
            "return_mean": float(flat_returns.mean()) if flat_returns.numel() else math.nan,
            "explained_variance": explained_variance(flat_old, flat_returns),
        }
        by_id = {id(t): a.tolist() for t, a in zip(trajs, adv[first : first + len(trajs)])}
        targets = ({id(t): v for t, v in zip(trajs, old)}, {id(t): r for t, r in zip(trajs, returns)})
        return by_id, targets, metrics

    def _micro_batches(self, trajs: Sequence[Any], advantages: dict[int, list[float]]) -> list[PackedBatch]:
        """The policy's micro-batches: per-token `advantages`, the rollout's `old_logprobs` (and `versions`
        for the proximal approximation)."""
        spec = self.cfg.actor.mb_spec
        fields = {"advantages": [advantages[id(t)] for t in trajs], "old_logprobs": [t.logprobs for t in trajs]}  # fmt: skip
        if self.objective.settings.reads_versions:
            fields["versions"] = [input_token_versions(t.versions) for t in trajs]
        mbs, _ = pack_trajectories(
            trajs, fields, max_tokens_per_mb=spec.max_tokens_per_mb or self.cfg.train_dataset.max_length
            + self.cfg.gconfig.max_new_tokens, n_mbs=max(1, self.rt.backend.min_micro_batches(self.cfg)),
            algorithm=spec.packing_algorithm, device=batch_device(self.rt.backend, self.rt),
        )  # fmt: skip
        return mbs
