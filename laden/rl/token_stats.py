"""Per-token helpers of the RL objectives: the documents of a packed row (`Sequences`), the KL
estimators (`kl_estimate`) and the token-weighted statistics (`TokenStats`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from laden.config.ppo_settings import KLEstimator
from laden.data.batch import PackedBatch

KL_CLAMP = 10.0
"""|KL estimate| per token is clamped to this (AReaL's `KLEstimator`), against exploding log-ratios."""


@dataclass(frozen=True, slots=True)
class Sequences:
    """The documents of a packed row: each token's document, loss tokens per document, document means."""

    index: torch.Tensor  # [T] long
    counts: torch.Tensor  # [D] fp32, loss tokens of each document

    @classmethod
    def of(cls, batch: PackedBatch, mask: torch.Tensor) -> Sequences:
        if sum(batch.seqlens) > batch.num_tokens:
            raise ValueError(
                f"the micro-batch holds {batch.num_tokens} tokens of documents of {sum(batch.seqlens)}: a "
                "context-parallel slice. Sequence-level importance sampling, rejection sampling and loss "
                "averaging need whole documents; train with c=1 in actor.backend, or use "
                "importance_sampling_level=token, rejection_sampling.level=token and loss_agg_mode=token-mean"
            )
        lengths = batch.cu_seqlens.diff()  # [D]
        ids = torch.arange(lengths.numel(), device=lengths.device)
        # output_size is known on the host, so repeat_interleave needs no device sync.
        index = torch.repeat_interleave(ids, lengths, output_size=batch.num_tokens)
        return cls(index, cls._count(index, lengths.numel(), mask))

    @staticmethod
    def _count(index: torch.Tensor, n: int, mask: torch.Tensor) -> torch.Tensor:
        return mask.new_zeros(n, dtype=torch.float32).index_add_(0, index, mask.float())

    def over(self, mask: torch.Tensor) -> Sequences:
        """The same documents with `mask` as their loss tokens."""
        return Sequences(self.index, self._count(self.index, self.counts.numel(), mask))

    def sums(self, values: torch.Tensor) -> torch.Tensor:
        """Per-document sums of `values [T]`, `[D]` (differentiable)."""
        return values.new_zeros(self.counts.shape).index_add(0, self.index, values)

    def means(self, values: torch.Tensor) -> torch.Tensor:
        """Per-document means of `values [T]` (0 off the loss tokens) over the loss tokens, `[D]`."""
        return self.sums(values) / self.counts.clamp(min=1)


def kl_estimate(
    logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator, *, clamp: bool = True
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled token, clamped to +-`KL_CLAMP` (`clamp`)."""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = log_ratio.square() / 2
    else:
        kl = torch.expm1(-log_ratio) + log_ratio
    return kl.clamp(-KL_CLAMP, KL_CLAMP) if clamp else kl


class TokenStats:
    """Per-token statistics summed over the loss tokens of every call since the last `pop`, kept as
    device tensors (no host sync): the PPO and value objectives' metrics. A statistic may have its own
    tokens (`add(..., own=...)`): its mean is then over those (AReaL's `behave_imp_weight` is over the
    tokens rejection sampling kept)."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}

    def add(
        self,
        per_token: dict[str, torch.Tensor],
        mask: torch.Tensor,
        own: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Add one micro-batch's statistics (`own`: name -> (values, its tokens)); return its sums, with its
        token count as `num_loss_tokens` (and each own-token statistic's count as `<name>/n`)."""
        sums = {name: torch.where(mask, v.detach().float(), 0.0).sum() for name, v in per_token.items()}
        sums["num_loss_tokens"] = mask.sum().float()
        for name, (v, tokens) in (own or {}).items():
            sums[name] = torch.where(tokens, v.detach().float(), 0.0).sum()
            sums[f"{name}/n"] = tokens.sum().float()
        for name, v in sums.items():
            self._sums[name] = self._sums[name] + v if name in self._sums else v
        return sums

    def pop(self) -> dict[str, torch.Tensor]:
        """Token-weighted means since the last pop, and `num_loss_tokens` (then reset)."""
        sums, self._sums = self._sums, {}
        return token_means(sums)


def token_means(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sums of `TokenStats.add` -> means over each statistic's tokens, and `num_loss_tokens`."""
    if not sums:
        return {}
    num = sums["num_loss_tokens"]
    out = {}
    for name, v in sums.items():
        if name.endswith("/n"):
            continue
        if name == "num_loss_tokens":
            out[name] = v
        else:
            out[name] = v / sums.get(f"{name}/n", num).clamp(min=1)
    return out
