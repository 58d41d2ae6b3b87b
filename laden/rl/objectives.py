"""PPO-family objectives on the final hidden states: clipped surrogate, GSPO, decoupled PPO with
AReaL 1.0.4's rejection sampling, M2PO, SAPO, KL.

`PPOObjective(settings)` is a `laden.engine.base.Objective`: from `hidden [T, H]`, the head
weight `[V, H]` and a packed micro-batch it returns the micro-batch's *summed* loss. The current
log-probs of the labels come from `laden.model.loss.chunked_token_logprobs_and_entropy` (at
most `[chunk_size, V]` fp32 logits at a time; its backward recomputes each chunk's logits, one
extra `[c, H] x [H, V]` GEMM per chunk instead of holding `T x V` logits). Everything after
that is `[T]` arithmetic.

Per-token inputs, `batch.fields` in the labels' layout (`laden.data.batch`; 0 where the
label is -100), named after AReaL's batch keys:
- `advantages`: A_t (AReaL `advantages`);
- `old_logprobs`: log pi_behav(label), from the rollout engine, or recomputed by the trainer
  (`TrainEngine.forward`) before the update (AReaL `logprobs`, or `prox_logp` with
  `recompute_logprob`);
- `prox_logprobs`: log pi_prox(label), recomputed by the trainer before the update; read only
  with `use_decoupled_loss` and `prox_logp_method` recompute or metrics (AReaL `prox_logp`);
- `versions`: the weight version of each label's input token (`laden.rl.prox_approx.input_token_versions`);
  read only with `prox_logp_method` loglinear or metrics (AReaL `versions`; the trained version is
  `PPOObjective.version`);
- `ref_logprobs`: log pi_ref(label) of the reference model; read only with `kl_ctl != 0`
  (AReaL `ref_logp`);
- `teacher_logprobs`: log pi_teacher(label) of the teacher; read only with `distill`
  (`DistillSettings`, AReaL `teacher_logp`).
Loss tokens are `labels != -100` (AReaL `loss_mask`); a sequence is a document of
`batch.cu_seqlens`. pi_old is pi_prox (decoupled: recomputed, or with `prox_logp_method: loglinear`
`laden.rl.prox_approx`'s approximation) or pi_behav. Per micro-batch, in AReaL 1.0.4's order:

    M2PO (m2_threshold): the loss tokens with the largest (log pi_behav - log pi_prox)^2 leave
        (`laden.rl.rejection.m2po_keep`); the micro-batch's loss is scaled by tokens / tokens kept
    rejection sampling: tokens leave the loss or have their weight clamped; w_t the behaviour
        weight (`laden.rl.rejection`)
    r_t = exp(logp_t - log pi_old)                      importance_sampling_level="token"
    r_t = exp(mean_{t' in seq}(logp_t' - log pi_old))   "sequence" (GSPO; A_t -> its sequence mean;
                                                        both means over the tokens rejection kept)
    l_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_clip, 1 + eps_clip_higher))
    l_t = min(l_t, -c_clip A_t) where A_t < 0           dual clip (c_clip)
    l_t = l_t * w_t                                     decoupled loss (see below)
    l_t = -A_t g_t, g_t = 4/tau sigmoid(tau (r_t - 1)), tau = sapo_tau_pos where A_t > 0, else
        sapo_tau_neg                                    SAPO (use_sapo_loss; instead of the clip)
    l_t = l_t + kl_ctl * clamp(k(logp_t, log pi_ref), -10, 10)   k1 / k2 / k3

With a teacher (`distill`, AReaL's joint loss of on-policy distillation and RL), with w_rl =
`rl_loss_weight`, w_d = `distill_loss_weight` and sg() a value held constant, on the loss tokens M2PO
kept (rejection sampling does not filter this term, as in AReaL):

    l_t = w_rl l_t + w_d (logp_t - log pi_teacher)                          w_rl > 0
    l_t = w_d exp(logp_t - log pi_behav) (sg(logp_t) - log pi_teacher)      w_rl = 0

The first is the sampled reverse KL to the teacher as a loss: its gradient is that of logp_t,
zero in expectation on on-policy samples, so it mostly keeps the term's value in view; the second
(pure distillation) is the policy gradient of -KL(pi || pi_teacher) with the per-token reward
log pi_teacher - log pi, importance-weighted from the behaviour policy: it is what moves the
policy toward the teacher. Both are AReaL's terms, and the metric `rkl_loss` is their per-token
value without w_d (AReaL's `rkl_loss`).

The decoupled loss's behaviour weight w_t comes in two semantics. AReaL 1.0.4's (`rejection_sampling`
set, or `apply_behav_imp_weight: false`): w_t is rejection sampling's weight, and without
`rejection_sampling` there is no weight at all. Before 1.0.4 (laden's `behav_imp_weight_cap`, AReaL's
earlier `behav_imp_weight_cap`): w_t = pi_prox / pi_behav on every loss token, 0 above the cap; the
capped tokens stay in the ratio's sequence means and in every statistic. `decoupled_semantics()`
says which one a setting gets.

`loss_agg_mode` "token-mean" returns `sum_t l_t` (the engine's normalizer: the global number
of loss tokens, so the step's loss is AReaL's token mean); "seq-mean-token-mean" returns
`sum_seq mean_{t in seq} l_t` (normalizer: the global number of sequences with loss tokens,
`loss_normalizer`). Rejected tokens still count in the means' denominators, as in AReaL.

Statistics as AReaL 1.0.4 computes them: means over the loss tokens (those M2PO kept) of
`importance_weight` and `clip_fraction`, which are 0 on rejected tokens, `approx_kl`, `entropy`;
`behav_imp_weight` and `behave_approx_kl` over the tokens rejection kept; `rs_filtered_fraction`;
with SAPO `sapo_soft_gate`, `sapo_scaled_gate_pos/neg`; with the decoupled loss `compute_logp/*`
(`laden.rl.prox_approx.approximation_stats`).

Differences from AReaL, chosen deliberately: the KL term is a loss on the current log-probs
(GRPO's beta * KL, TRL's `beta`), not a penalty AReaL folds into the rewards before GAE, so it
has a gradient without a critic; its default is therefore 0. `loss_agg_mode` is verl's name (AReaL
only has the token mean). Micro-batches are laden's (`mb_spec`), so M2PO's per-micro-batch selection
sees laden's packing of the tokens. `rs_filtered_fraction` is a token mean over the step, where AReaL
averages the micro-batches' fractions. The `compute_logp/*` statistics are logged with the decoupled
loss only (AReaL logs its drift estimators on every run). The KL term, laden's, leaves with the tokens
rejection sampling masks.

Sequence-level modes need whole documents: a context-parallel slice (`actor.backend` with
`c > 1`) would give per-slice means, so it raises instead. `last_stats` holds the latest
micro-batch's statistics as device tensors (no host sync, but M2PO's selection syncs once);
`pop_stats` averages them over every call since the previous pop, weighted by loss tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from laden.config.ppo_settings import PPOSettings, RejectionSampling
from laden.data.batch import IGNORE_INDEX, PackedBatch, unpack
from laden.model.loss import DEFAULT_LOSS_CHUNK_SIZE, chunked_token_logprobs_and_entropy
from laden.rl.prox_approx import approximate, approximation_stats
from laden.rl.rejection import m2po_keep, reject
from laden.rl.token_stats import KL_CLAMP, Sequences, TokenStats, kl_estimate, token_means

__all__ = [
    "KL_CLAMP",
    "DistillSettings",
    "PPOObjective",
    "PPOSettings",
    "RejectionSampling",
    "TokenStats",
    "kl_estimate",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class DistillSettings:
    """On-policy distillation from a teacher (AReaL's `teacher.rl_loss_weight`, `distill_loss_weight`)."""

    rl_loss_weight: float = 1.0
    """Weight of the RL loss (the PPO loss with its KL term); 0 = the teacher term alone, importance-weighted."""
    distill_loss_weight: float = 0.005
    """Weight of the teacher term; AReaL's default."""

    def __post_init__(self) -> None:
        for name in ("rl_loss_weight", "distill_loss_weight"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise ValueError(
                    f"teacher.{name}={value} must be a finite number >= 0; use e.g. 1.0 or 0.005"
                )
        if self.rl_loss_weight == 0 and self.distill_loss_weight == 0:
            raise ValueError("teacher.rl_loss_weight=0 and teacher.distill_loss_weight=0 leave no loss; set "
                             "distill_loss_weight > 0")  # fmt: skip


class PPOObjective:
    """Summed PPO-family loss of a micro-batch (see the module docstring); an `Objective`."""

    def __init__(
        self,
        settings: PPOSettings | None = None,
        *,
        chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE,
        distill: DistillSettings | None = None,
    ) -> None:
        if chunk_size < 1:
            raise ValueError(f"actor.loss_chunk_size={chunk_size} must be >= 1 token, e.g. 1024")
        self.settings = settings if settings is not None else PPOSettings()
        self.distill = distill
        """The teacher term (reads the field `teacher_logprobs`); None = no teacher."""
        self.chunk_size = chunk_size
        self.version = 0
        """The weight version being trained (the proximal approximation's v; the trainer sets it each step)."""
        self.last_stats: dict[str, torch.Tensor] = {}
        """The latest micro-batch's statistics: means over its loss tokens, and `num_loss_tokens`."""
        self._stats = TokenStats()

    def __call__(self, hidden: torch.Tensor, head_weight: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        s = self.settings
        labels = batch.labels.reshape(-1)  # [T]
        loss_tokens = labels != IGNORE_INDEX
        logp, entropy = chunked_token_logprobs_and_entropy(
            hidden.reshape(-1, hidden.shape[-1]),
            head_weight,
            labels,
            chunk_size=self.chunk_size,
            temperature=s.temperature,
        )
        seqs = Sequences.of(batch, loss_tokens) if s.needs_sequences else None
        behav = _field(batch, "old_logprobs")
        prox, approx = self._proximal(batch, behav, logp)
        stats: dict[str, torch.Tensor] = {}
        own: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        mask, scale = loss_tokens, None
        if s.m2_threshold is not None:
            mask = m2po_keep(behav, prox, loss_tokens, s.m2_threshold)
            scale = loss_tokens.sum().float() / mask.sum().clamp(min=1).float()
            own["m2po_masked_fraction"] = ((loss_tokens & ~mask).float(), loss_tokens)
        keep, weight, behave_mask = mask, None, mask
        if s.rejection_sampling is not None:
            rej = reject(prox, behav, mask, None if seqs is None else seqs.index, s.rejection_sampling)
            keep, weight = rej.keep, rej.weight
            behave_mask = (weight > 0) & keep
            own |= {
                "behav_imp_weight": (weight, behave_mask),
                "behave_approx_kl": (prox - behav, behave_mask),
                "rs_filtered_fraction": (rej.filtered.float(), mask),
            }
        elif s.use_decoupled_loss and s.apply_behav_imp_weight:
            weight, capped = self._behaviour_weight(prox, behav, mask)
            stats.update(behav_imp_weight=weight, behav_capped_fraction=capped.float())
        log_ratio = torch.where(keep, logp - prox, 0.0)  # [T]
        ratio, advantages = self._ratio(log_ratio, _field(batch, "advantages"), keep, seqs)
        if s.use_sapo_loss:
            losses = self._sapo(ratio, advantages.detach(), stats)
        else:
            losses = self._token_losses(ratio, advantages, keep, stats)
        if weight is not None:
            losses = losses * weight
        if s.kl_ctl != 0:
            kl = kl_estimate(logp, _field(batch, "ref_logprobs"), s.kl_estimator)
            losses = losses + s.kl_ctl * kl
            stats["kl"] = kl
        losses = torch.where(keep, losses, 0.0)  # [T]
        if self.distill is not None:  # on the tokens M2PO kept, rejected ones too (AReaL's loss_mask)
            losses, stats["rkl_loss"] = self._with_teacher(
                losses, logp, behav, _field(batch, "teacher_logprobs")
            )
            losses = torch.where(mask, losses, 0.0)
        stats.update(approx_kl=logp - prox, importance_weight=ratio, entropy=entropy)
        own |= {name: (v, behave_mask) for name, v in approx.items()}  # AReaL 1.0.4's compute_logp tokens
        self.last_stats = token_means(self._stats.add(stats, mask, own))
        if seqs is not None and s.loss_agg_mode == "seq-mean-token-mean":
            return seqs.means(losses).sum()
        return losses.sum() if scale is None else losses.sum() * scale

    def _proximal(
        self, batch: PackedBatch, behav: torch.Tensor, logp: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(log pi_old per token, the `compute_logp/*` statistics per token)."""
        s = self.settings
        if not s.use_decoupled_loss:
            return behav, {}
        versions = _field(batch, "versions", torch.long) if s.reads_versions else None
        recomputed = None if s.prox_logp_method == "loglinear" else _field(batch, "prox_logprobs")
        if recomputed is None:
            assert versions is not None
            prox = approximate("loglinear", behav, logp.detach(), versions, self.version)
        else:
            prox = recomputed
        return prox, approximation_stats(s.prox_logp_method, behav, logp, versions, self.version, recomputed)

    def _ratio(
        self, log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, seqs: Sequences | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(importance ratio, advantage) per token, 0 off `mask`: the token's own, or its sequence's (GSPO)."""
        if self.settings.importance_sampling_level == "token":
            return torch.where(mask, log_ratio.exp(), 0.0), advantages
        assert seqs is not None
        kept = seqs.over(mask)
        ratio = torch.where(mask, kept.means(log_ratio).exp()[seqs.index], 0.0)
        return ratio, torch.where(mask, kept.means(torch.where(mask, advantages, 0.0))[seqs.index], 0.0)

    def _with_teacher(
        self, losses: torch.Tensor, logp: torch.Tensor, behav: torch.Tensor, teacher: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-token loss with the teacher term, the term without its weight); see the module docstring."""
        d = self.distill
        assert d is not None
        if d.rl_loss_weight == 0:
            term = (logp - behav).exp() * (logp.detach() - teacher)
            return d.distill_loss_weight * term, term
        term = logp - teacher
        return d.rl_loss_weight * losses + d.distill_loss_weight * term, term

    def _behaviour_weight(
        self, prox: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Before 1.0.4: (pi_prox / pi_behav per token, 0 above `behav_imp_weight_cap`; the capped tokens)."""
        weight = torch.where(mask, prox - behav, 0.0).exp()
        cap = self.settings.behav_imp_weight_cap
        keep = mask if cap is None else mask & (weight <= cap)
        return torch.where(keep, weight, 0.0), mask & ~keep

    def _token_losses(
        self,
        ratio: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        stats: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """The clipped (and dual-clipped) surrogate per token; which tokens each clip bound go to `stats`."""
        s = self.settings
        unclipped = -advantages * ratio
        clipped = -advantages * ratio.clamp(1.0 - s.eps_clip, s.clip_high)
        losses = torch.maximum(unclipped, clipped)
        stats["clip_fraction"] = (mask & (unclipped < clipped)).float()
        if s.c_clip is not None:
            bound = -s.c_clip * advantages
            dual = (advantages < 0) & (losses > bound)
            losses = torch.where(dual, bound, losses)
            stats["dual_clip_fraction"] = (mask & dual).float()
        return losses

    def _sapo(
        self, ratio: torch.Tensor, advantages: torch.Tensor, stats: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """SAPO's loss per token, `-A_t g_t` with its soft gates (module docstring)."""
        s = self.settings
        pos = torch.sigmoid(s.sapo_tau_pos * (ratio - 1.0)) * (4.0 / s.sapo_tau_pos)
        neg = torch.sigmoid(s.sapo_tau_neg * (ratio - 1.0)) * (4.0 / s.sapo_tau_neg)
        gate = torch.where(advantages > 0, pos, neg)
        stats.update(sapo_soft_gate=gate, sapo_scaled_gate_pos=pos, sapo_scaled_gate_neg=neg)
        stats["clip_fraction"] = torch.zeros_like(ratio)
        return -gate * advantages

    def pop_stats(self) -> dict[str, torch.Tensor]:
        """Token-weighted means of the statistics over every call since the last pop (then reset)."""
        return self._stats.pop()

    def loss_normalizer(self, micro_batches: Sequence[PackedBatch]) -> int:
        """What these (host) micro-batches add to the engine's `normalizer` under `loss_agg_mode`.

        Loss tokens for `token-mean`, sequences with at least one loss token for
        `seq-mean-token-mean`. Sum it over data-parallel ranks, or call it on the whole global batch.
        """
        if self.settings.loss_agg_mode == "token-mean":
            return sum(mb.num_loss_tokens for mb in micro_batches)
        return sum(
            bool(doc.any())  # host tensors: no device sync
            for mb in micro_batches
            for doc in unpack(mb, mb.labels != IGNORE_INDEX)
        )


def _field(batch: PackedBatch, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`batch.fields[name]` as `[T]` `dtype`, or an error that says how to provide it."""
    try:
        value = batch.fields[name]
    except KeyError:
        raise ValueError(
            f"PPOObjective needs the per-token field {name!r} (have {sorted(batch.fields)}); pack it with "
            f"pack_samples(..., fields={{{name!r}: ...}}) or batch.with_fields({name}=...)"
        ) from None
    if value.shape != batch.labels.shape:
        raise ValueError(
            f"field {name!r} has shape {tuple(value.shape)}; per-token fields must be laid out like the labels, "
            f"[{batch.labels.numel()}]"
        )
    return value.to(dtype)
