"""PPO-family objectives on the final hidden states: clipped surrogate, GSPO, decoupled PPO, KL.

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
  with `use_decoupled_loss` (AReaL `prox_logp`);
- `ref_logprobs`: log pi_ref(label) of the reference model; read only with `kl_ctl != 0`
  (AReaL `ref_logp`);
- `teacher_logprobs`: log pi_teacher(label) of the teacher; read only with `distill`
  (`DistillSettings`, AReaL `teacher_logp`).
Loss tokens are `labels != -100` (AReaL `loss_mask`); a sequence is a document of
`batch.cu_seqlens`. With pi_old = pi_prox (decoupled) or pi_behav, per loss token:

    r_t = exp(logp_t - log pi_old)                      importance_sampling_level="token"
    r_t = exp(mean_{t' in seq}(logp_t' - log pi_old))   "sequence" (GSPO; A_t -> its sequence mean)
    l_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_clip, 1 + eps_clip_higher))
    l_t = min(l_t, -c_clip A_t) where A_t < 0           dual clip (c_clip)
    l_t = l_t * w_t, w_t = exp(log pi_prox - log pi_behav), 0 above behav_imp_weight_cap
    l_t = l_t + kl_ctl * clamp(k(logp_t, log pi_ref), -10, 10)   k1 / k2 / k3

With a teacher (`distill`, AReaL's joint loss of on-policy distillation and RL), with w_rl =
`rl_loss_weight`, w_d = `distill_loss_weight` and sg() a value held constant:

    l_t = w_rl l_t + w_d (logp_t - log pi_teacher)                          w_rl > 0
    l_t = w_d exp(logp_t - log pi_behav) (sg(logp_t) - log pi_teacher)      w_rl = 0

The first is the sampled reverse KL to the teacher as a loss: its gradient is that of logp_t,
zero in expectation on on-policy samples, so it mostly keeps the term's value in view; the second
(pure distillation) is the policy gradient of -KL(pi || pi_teacher) with the per-token reward
log pi_teacher - log pi, importance-weighted from the behaviour policy: it is what moves the
policy toward the teacher. Both are AReaL's terms, and the metric `rkl_loss` is their per-token
value without w_d (AReaL's `rkl_loss`).

`loss_agg_mode` "token-mean" returns `sum_t l_t` (the engine's normalizer: the global number
of loss tokens, so the step's loss is AReaL's token mean); "seq-mean-token-mean" returns
`sum_seq mean_{t in seq} l_t` (normalizer: the global number of sequences with loss tokens,
`loss_normalizer`). Tokens above the cap still count in the means' denominators, as in AReaL.

Differences from AReaL, chosen deliberately: the KL term is a loss on the current log-probs
(GRPO's beta * KL, TRL's `beta`), not a penalty AReaL folds into the rewards before GAE, so it
has a gradient without a critic; its default is therefore 0. `loss_agg_mode` is verl's name (AReaL
only has the token mean). The cap's mask is a hard filter (AReaL's `behav_imp_weight_cap`
before its `rejection_sampling` generalisation).

Sequence-level modes need whole documents: a context-parallel slice (`actor.backend` with
`c > 1`) would give per-slice means, so it raises instead. `last_stats` holds the latest
micro-batch's statistics as device tensors (no host sync); `pop_stats` averages them over every
call since the previous pop, weighted by loss tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from laden.data.batch import IGNORE_INDEX, PackedBatch, unpack
from laden.model.loss import DEFAULT_LOSS_CHUNK_SIZE, chunked_token_logprobs_and_entropy

ImportanceSamplingLevel = Literal["token", "sequence"]
LossAggMode = Literal["token-mean", "seq-mean-token-mean"]
KLEstimator = Literal["k1", "k2", "k3"]
KL_CLAMP = 10.0
"""|KL estimate| per token is clamped to this (AReaL's `KLEstimator`), against exploding log-ratios."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PPOSettings:
    """The PPO-family loss (AReaL's `actor.*` names; defaults AReaL's, but `kl_ctl=0`)."""

    eps_clip: float = 0.2
    """The ratio is clipped to `[1 - eps_clip, 1 + eps_clip_higher]`."""
    eps_clip_higher: float | None = None
    """Upper clip (DAPO's clip-higher, e.g. 0.28); None = `eps_clip`."""
    c_clip: float | None = None
    """Dual clip: the loss of a negative advantage is at most `c_clip * |A|`; > 1, None = off."""
    importance_sampling_level: ImportanceSamplingLevel = "token"
    """`token`: a ratio per token (PPO); `sequence`: the sequence's geometric-mean ratio (GSPO)."""
    loss_agg_mode: LossAggMode = "token-mean"
    """`token-mean`: every loss token counts once; `seq-mean-token-mean`: every sequence does."""
    use_decoupled_loss: bool = False
    """Decoupled PPO: ratio against `prox_logprobs`, times the behaviour weight pi_prox / pi_behav."""
    behav_imp_weight_cap: float | None = None
    """Decoupled only: tokens whose behaviour weight exceeds this (> 1) leave the loss; None = off."""
    kl_ctl: float = 0.0
    """Coefficient of the per-token KL(pi || pi_ref) loss term; 0 = off (no reference model)."""
    kl_estimator: KLEstimator = "k1"
    """`k1`: log r; `k2`: (log r)^2 / 2; `k3`: 1/r - 1 + log r, with r = pi / pi_ref (Schulman)."""
    temperature: float = 1.0
    """Logits are divided by it, as in sampling (`gconfig.temperature`)."""

    def __post_init__(self) -> None:
        errors = self.errors()
        if errors:
            raise ValueError("invalid PPO settings:\n  " + "\n  ".join(errors))

    def errors(self) -> list[str]:
        """Every invalid field as `actor.<field>=<value> <reason>; <fix>` (empty when valid)."""
        errors = []
        if not 0 < self.eps_clip < 1:
            errors.append(
                f"actor.eps_clip={self.eps_clip} must be in (0, 1) (the ratio's lower clip is "
                "1 - eps_clip); use 0.2"
            )
        if self.eps_clip_higher is not None and not 0 < self.eps_clip_higher < math.inf:
            errors.append(
                f"actor.eps_clip_higher={self.eps_clip_higher} must be > 0; use e.g. 0.28, or null for eps_clip"
            )
        if self.c_clip is not None and not 1 < self.c_clip < math.inf:
            errors.append(
                f"actor.c_clip={self.c_clip} must be > 1 (the loss of a negative advantage is capped at "
                "c_clip * |A|); use e.g. 3.0, or null to turn dual clipping off"
            )
        errors += _choice("importance_sampling_level", self.importance_sampling_level, ("token", "sequence"))
        errors += _choice("loss_agg_mode", self.loss_agg_mode, ("token-mean", "seq-mean-token-mean"))
        errors += _choice("kl_estimator", self.kl_estimator, ("k1", "k2", "k3"))
        cap = self.behav_imp_weight_cap
        if cap is not None and not self.use_decoupled_loss:
            errors.append(
                f"actor.behav_imp_weight_cap={cap} is only read by the decoupled loss; set "
                "actor.use_decoupled_loss=true, or behav_imp_weight_cap to null"
            )
        if cap is not None and not 1 < cap < math.inf:
            errors.append(f"actor.behav_imp_weight_cap={cap} must be > 1; use e.g. 5.0, or null")
        if not 0 <= self.kl_ctl < math.inf:
            errors.append(
                f"actor.kl_ctl={self.kl_ctl} must be a finite number >= 0; use 0.0 to turn the KL term off"
            )
        if not 0 < self.temperature < math.inf:
            errors.append(
                f"actor.temperature={self.temperature} must be > 0 (the sampling temperature); use 1.0"
            )
        return errors

    @property
    def clip_high(self) -> float:
        """The upper clip bound, `1 + (eps_clip_higher or eps_clip)`."""
        return 1.0 + (self.eps_clip if self.eps_clip_higher is None else self.eps_clip_higher)

    @property
    def needs_sequences(self) -> bool:
        """Whether the loss reduces over whole sequences (GSPO ratios or sequence-level averaging)."""
        return self.importance_sampling_level == "sequence" or self.loss_agg_mode == "seq-mean-token-mean"


def _choice(name: str, value: object, choices: tuple[str, ...]) -> list[str]:
    if value in choices:
        return []
    return [f"actor.{name}={value!r} is not known; use one of {', '.join(choices)}"]


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


@dataclass(frozen=True, slots=True)
class _Sequences:
    """The documents of a packed row: each token's document, loss tokens per document, document means."""

    index: torch.Tensor  # [T] long
    counts: torch.Tensor  # [D] fp32, loss tokens of each document

    @classmethod
    def of(cls, batch: PackedBatch, mask: torch.Tensor) -> _Sequences:
        if sum(batch.seqlens) > batch.num_tokens:
            raise ValueError(
                f"the micro-batch holds {batch.num_tokens} tokens of documents of {sum(batch.seqlens)}: a "
                "context-parallel slice. Sequence-level importance sampling and loss averaging need whole "
                "documents; train with c=1 in actor.backend, or use importance_sampling_level=token and "
                "loss_agg_mode=token-mean"
            )
        lengths = batch.cu_seqlens.diff()  # [D]
        ids = torch.arange(lengths.numel(), device=lengths.device)
        # output_size is known on the host, so repeat_interleave needs no device sync.
        index = torch.repeat_interleave(ids, lengths, output_size=batch.num_tokens)
        counts = mask.new_zeros(lengths.numel(), dtype=torch.float32).index_add_(0, index, mask.float())
        return cls(index, counts)

    def sums(self, values: torch.Tensor) -> torch.Tensor:
        """Per-document sums of `values [T]`, `[D]` (differentiable)."""
        return values.new_zeros(self.counts.shape).index_add(0, self.index, values)

    def means(self, values: torch.Tensor) -> torch.Tensor:
        """Per-document means of `values [T]` (0 off the loss tokens) over the loss tokens, `[D]`."""
        return self.sums(values) / self.counts.clamp(min=1)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled token, clamped to +-`KL_CLAMP`."""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = log_ratio.square() / 2
    else:
        kl = torch.expm1(-log_ratio) + log_ratio
    return kl.clamp(-KL_CLAMP, KL_CLAMP)


class TokenStats:
    """Per-token statistics summed over the loss tokens of every call since the last `pop`, kept as
    device tensors (no host sync): the PPO and value objectives' metrics."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}

    def add(self, per_token: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Add one micro-batch's statistics; return its sums, with its token count as `num_loss_tokens`."""
        sums = {name: torch.where(mask, v.detach().float(), 0.0).sum() for name, v in per_token.items()}
        sums["num_loss_tokens"] = mask.sum().float()
        for name, v in sums.items():
            self._sums[name] = self._sums[name] + v if name in self._sums else v
        return sums

    def pop(self) -> dict[str, torch.Tensor]:
        """Token-weighted means since the last pop, and `num_loss_tokens` (then reset)."""
        sums, self._sums = self._sums, {}
        return _token_means(sums)


def _token_means(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not sums:
        return {}
    num = sums["num_loss_tokens"]
    return {name: v if name == "num_loss_tokens" else v / num.clamp(min=1) for name, v in sums.items()}


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
        self.last_stats: dict[str, torch.Tensor] = {}
        """The latest micro-batch's statistics: means over its loss tokens, and `num_loss_tokens`."""
        self._stats = TokenStats()

    def __call__(self, hidden: torch.Tensor, head_weight: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        s = self.settings
        labels = batch.labels.reshape(-1)  # [T]
        mask = labels != IGNORE_INDEX
        logp, entropy = chunked_token_logprobs_and_entropy(
            hidden.reshape(-1, hidden.shape[-1]),
            head_weight,
            labels,
            chunk_size=self.chunk_size,
            temperature=s.temperature,
        )
        seqs = _Sequences.of(batch, mask) if s.needs_sequences else None
        behav = _field(batch, "old_logprobs")
        prox = _field(batch, "prox_logprobs") if s.use_decoupled_loss else behav
        log_ratio = torch.where(mask, logp - prox, 0.0)  # [T]
        ratio, advantages = self._ratio(log_ratio, _field(batch, "advantages"), mask, seqs)
        losses, stats = self._token_losses(ratio, advantages, mask)
        if s.use_decoupled_loss:
            weight, keep = self._behaviour_weight(prox, behav, mask)
            losses = losses * weight
            stats.update(behav_imp_weight=weight, behav_capped_fraction=(mask & ~keep).float())
        if s.kl_ctl != 0:
            kl = kl_estimate(logp, _field(batch, "ref_logprobs"), s.kl_estimator)
            losses = losses + s.kl_ctl * kl
            stats["kl"] = kl
        if self.distill is not None:
            losses, stats["rkl_loss"] = self._with_teacher(
                losses, logp, behav, _field(batch, "teacher_logprobs")
            )
        losses = torch.where(mask, losses, 0.0)  # [T]
        stats.update(approx_kl=log_ratio, importance_weight=ratio, entropy=entropy)
        self._record(stats, mask)
        if seqs is not None and s.loss_agg_mode == "seq-mean-token-mean":
            return seqs.means(losses).sum()
        return losses.sum()

    def _ratio(
        self, log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, seqs: _Sequences | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(importance ratio, advantage) per token: the token's own, or its sequence's (GSPO)."""
        if self.settings.importance_sampling_level == "token":
            return log_ratio.exp(), advantages
        assert seqs is not None
        ratio = seqs.means(log_ratio).exp()[seqs.index]
        return ratio, seqs.means(torch.where(mask, advantages, 0.0))[seqs.index]

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
        """(pi_prox / pi_behav per token, 0 off `keep`; `keep`: loss tokens within `behav_imp_weight_cap`)."""
        weight = torch.where(mask, prox - behav, 0.0).exp()
        cap = self.settings.behav_imp_weight_cap
        keep = mask if cap is None else mask & (weight <= cap)
        return torch.where(keep, weight, 0.0), keep

    def _token_losses(
        self, ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The clipped (and dual-clipped) surrogate per token, and which tokens each clip bound."""
        s = self.settings
        unclipped = -advantages * ratio
        clipped = -advantages * ratio.clamp(1.0 - s.eps_clip, s.clip_high)
        losses = torch.maximum(unclipped, clipped)
        stats = {"clip_fraction": (mask & (unclipped < clipped)).float()}
        if s.c_clip is not None:
            bound = -s.c_clip * advantages
            dual = (advantages < 0) & (losses > bound)
            losses = torch.where(dual, bound, losses)
            stats["dual_clip_fraction"] = (mask & dual).float()
        return losses, stats

    def _record(self, per_token: dict[str, torch.Tensor], mask: torch.Tensor) -> None:
        """Sum each statistic over the loss tokens; `last_stats` gets the means (device tensors)."""
        self.last_stats = _token_means(self._stats.add(per_token, mask))

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


def _field(batch: PackedBatch, name: str) -> torch.Tensor:
    """`batch.fields[name]` as `[T]` fp32, or an error that says how to provide it."""
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
    return value.float()
