"""Pair objectives on the final hidden states: DPO (sigmoid or IPO) and the pairwise reward-model loss.

A micro-batch holds whole pairs: its documents are `chosen_0, rejected_0, chosen_1, rejected_1, ...`
(`laden.align.data.pack_pairs`), a padding document without loss tokens possibly last (left out; a data-
parallel rank with fewer micro-batches than another runs the engine's padding micro-batch, one such
document, and adds a zero loss and no pair). Both objectives are
`laden.engine.base.Objective`s: they return the *sum* of the per-pair losses of the micro-batch, and
the trainer passes the global number of pairs as the engine's normalizer, so a step's loss is the
mean over the pairs of the global batch however they are split (AReaL weighs its micro-batches by
their pairs too).

DPO (Rafailov et al. 2023; AReaL's `compute_dpo_loss`): with log pi(y|x) summed over a completion's
loss tokens (fp64 sums, as AReaL's, so long completions keep the sign of their log-ratio) and
log pi_ref(y|x) the same sum of the per-token field `ref_logprobs` (the frozen reference model's,
laid out like the labels),

    sigmoid: l = -log sigmoid(beta * ((pi_c - pi_r) - (ref_c - ref_r)))
    ipo:     l = ((pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r - 1 / (2 beta))^2

with n the completion's loss tokens (IPO's per-token normalisation, AReaL's and TRL's). Statistics
per pair: `chosen_reward` = beta (pi_c - ref_c), `rejected_reward`, `accuracy` (chosen_reward >
rejected_reward), `margin` (their difference), `loss`.

Reward model (AReaL's `compute_rw_loss`): the model is a value model (`laden.model.value_head`: a
one-row head), its score of a sequence the value at the sequence's last token (the EOS appended to
each completion); l = -log sigmoid(s_c - s_r). Statistics: `chosen_score`, `rejected_score`,
`accuracy` (s_c > s_r), `margin` (s_c - s_r), `loss`.

Both need whole documents: a context-parallel slice would give partial sums (validation refuses
`c > 1` for these jobs). Statistics are kept as device sums (no host sync) until `pop_sums`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from laden.data.batch import IGNORE_INDEX, PackedBatch
from laden.model.loss import DEFAULT_LOSS_CHUNK_SIZE, chunked_token_logprobs
from laden.model.value_head import token_values

DPOLossType = Literal["sigmoid", "ipo"]
PAIR_STATS = ("loss", "accuracy", "margin")
"""The statistics both objectives report per pair (each also has its chosen/rejected pair)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DPOSettings:
    """DPO's loss (AReaL's `actor.beta`, `actor.loss_type`)."""

    beta: float = 0.1
    """Strength of the implicit KL constraint to the reference model; > 0."""
    loss_type: DPOLossType = "sigmoid"
    """`sigmoid`: DPO's logistic loss; `ipo`: IPO's squared loss on length-normalised log-ratios."""

    def __post_init__(self) -> None:
        if not (self.beta > 0 and math.isfinite(self.beta)):
            raise ValueError(
                f"actor.beta={self.beta} must be > 0 (DPO's KL strength; the loss is flat at 0); use 0.1"
            )
        if self.loss_type not in ("sigmoid", "ipo"):
            raise ValueError(
                f"actor.loss_type={self.loss_type!r} is not one of 'sigmoid', 'ipo'; use sigmoid"
            )


def _pair_documents(batch: PackedBatch) -> int:
    """How many of the micro-batch's documents are pairs' (`2 P`): all of them, or all but a last one without
    loss tokens (an engine's padding micro-batch, `laden.engine.parallel.padding`, is one such document)."""
    count = len(batch.seqlens)
    if count % 2 == 0:
        return count
    start = sum(batch.seqlens[:-1])
    if not (batch.labels[start : start + batch.seqlens[-1]] != IGNORE_INDEX).any():
        # deliberate host sync, on odd counts only (padding): the last document must carry no loss token
        return count - 1
    raise ValueError(
        f"a pair micro-batch holds {count} documents; it must hold chosen/rejected pairs "
        "(laden.align.data.pack_pairs), with at most a padding document without loss tokens last"
    )


def document_sums(values: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """`[P, 2]` fp64 per-pair sums of `values [T]` over each document's loss tokens (labels != -100);
    column 0 the chosen document, column 1 the rejected one; a padding document last is left out.
    Differentiable (a micro-batch of padding only gives `[0, 2]`, still on the graph)."""
    pairs = _pair_documents(batch)
    n = sum(batch.seqlens)
    lengths = torch.tensor(batch.seqlens, device=values.device)
    doc = torch.repeat_interleave(torch.arange(len(batch.seqlens), device=values.device), lengths)
    kept = torch.where(batch.labels[:n] != IGNORE_INDEX, values[:n].double(), 0.0)
    sums = torch.zeros(len(batch.seqlens), dtype=torch.float64, device=values.device)
    return sums.index_add(0, doc, kept)[:pairs].view(-1, 2)


def last_token_values(values: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """`[P, 2]` fp32: each document's value at its last token, chosen then rejected per pair (a padding
    document last is left out)."""
    pairs = _pair_documents(batch)
    ends = torch.tensor(batch.seqlens[:pairs], device=values.device, dtype=torch.long).cumsum(0) - 1
    return values[ends].float().view(-1, 2)


class PairSums:
    """Per-pair statistics summed on the device since the last pop, with the number of pairs."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}

    def add(self, per_pair: dict[str, torch.Tensor]) -> None:
        """Add `[P]` statistics (detached); `pairs` counts them."""
        first = next(iter(per_pair.values()))
        values = {"pairs": torch.full((), float(first.shape[0]), device=first.device), **per_pair}
        for name, value in values.items():
            total = value.detach().double().sum()
            self._sums[name] = self._sums[name] + total if name in self._sums else total

    def pop(self) -> dict[str, torch.Tensor]:
        """The sums (with `pairs`) since the last pop; empty when no pair was seen. Resets."""
        out, self._sums = self._sums, {}
        return out


class DPOObjective:
    """Summed DPO loss of a micro-batch of pairs (see the module docstring); an `Objective`."""

    def __init__(self, settings: DPOSettings, *, chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE) -> None:
        self.settings = settings
        self.chunk_size = chunk_size
        self.sums = PairSums()

    def __call__(self, hidden: torch.Tensor, head_weight: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        try:
            ref_logprobs = batch.fields["ref_logprobs"]  # an engine's padding micro-batch reads zeros
        except KeyError:
            raise ValueError(
                f"DPOObjective needs the per-token field 'ref_logprobs' (have {sorted(batch.fields)}): the "
                "reference model's log-probs of the labels, pack_pairs(..., ref_logprobs=...)"
            ) from None
        hidden = hidden.reshape(-1, hidden.shape[-1])
        logp = chunked_token_logprobs(
            hidden, head_weight, batch.labels.reshape(-1), chunk_size=self.chunk_size
        )
        policy = document_sums(logp, batch)  # [P, 2]
        ref = document_sums(ref_logprobs, batch)
        losses, stats = dpo_pair_losses(policy, ref, self._lengths(batch), self.settings)
        self.sums.add({**stats, "loss": losses})
        return losses.sum().float()

    @staticmethod
    def _lengths(batch: PackedBatch) -> torch.Tensor:
        ones = torch.ones(batch.labels.shape, dtype=torch.float64, device=batch.labels.device)
        return document_sums(ones, batch)


def dpo_pair_losses(
    policy: torch.Tensor, ref: torch.Tensor, lengths: torch.Tensor, settings: DPOSettings
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair DPO losses `[P]` from `[P, 2]` summed log-probs (policy, reference) and loss-token counts."""
    beta = settings.beta
    chosen_ratio, rejected_ratio = policy[:, 0] - ref[:, 0], policy[:, 1] - ref[:, 1]
    if settings.loss_type == "ipo":
        logits = chosen_ratio / lengths[:, 0].clamp(min=1) - rejected_ratio / lengths[:, 1].clamp(min=1)
        losses = (logits - 1.0 / (2.0 * beta)).square()
    else:
        losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    with torch.no_grad():
        chosen, rejected = beta * chosen_ratio, beta * rejected_ratio
        stats = {"chosen_reward": chosen, "rejected_reward": rejected,
                 "accuracy": (chosen > rejected).double(), "margin": chosen - rejected}  # fmt: skip
    return losses, stats


class PairwiseRewardObjective:
    """Summed pairwise reward-model loss of a micro-batch of pairs (see the module docstring); an `Objective`.

    The head must be a value model's one-row head (`laden.model.value_head.to_value_model`)."""

    def __init__(self) -> None:
        self.sums = PairSums()

    def __call__(self, hidden: torch.Tensor, head_weight: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        scores = last_token_values(token_values(hidden, head_weight), batch)  # [P, 2]
        margin = scores[:, 0] - scores[:, 1]
        losses = -F.logsigmoid(margin)
        self.sums.add({"loss": losses, "accuracy": (margin > 0).float(), "margin": margin,
                       "chosen_score": scores[:, 0], "rejected_score": scores[:, 1]})  # fmt: skip
        return losses.sum()
