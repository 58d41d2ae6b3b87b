"""Off-policy corrections of the decoupled loss, as AReaL 1.0.4 defines them: rejection sampling of
stale tokens (`RejectionSampling`, AReaL's `actor.rejection_sampling`) and M2PO's second-moment token
filter (`m2po_keep`).

Rejection sampling compares the proximal policy with the behaviour policy (the rollout engine's),
per token `d_t = log pi_prox - log pi_behav` (0 where it is not finite), through a `metric`:
`ratio` exp(d), `kl_k1` d, `kl_k2` d^2 / 2, `kl_k3` exp(-d) - 1 + d. At `level: token` each loss token
is judged alone; at `level: sequence` every token of a document shares its document's value: for
`ratio` aggregated in log space (`mean` = the geometric mean of the ratios, `sum` = their product,
`max` = the largest), for the KL metrics arithmetically. A value is in bounds when
`lower <= value <= upper` (`lower` None: no lower bound). `action: mask` removes the out-of-bounds
tokens from the loss mask; `action: clamp` keeps them and clamps their behaviour weight to
`[lower or 0, upper]`. The behaviour weight is exp(d) per token, or at sequence level with `ratio` the
document's geometric-mean ratio; it is 0 off the (updated) loss mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from laden.config.ppo_settings import RejectionSampling
from laden.rl.token_stats import kl_estimate


@dataclass(frozen=True, slots=True)
class Rejection:
    """What rejection sampling leaves: the loss mask, the behaviour weight, the tokens it filtered."""

    keep: torch.Tensor  # [T] bool
    weight: torch.Tensor  # [T] fp32, 0 off `keep`
    filtered: torch.Tensor  # [T] bool: the loss tokens rejected (mask) or whose weight was clamped (clamp)


def reject(
    prox: torch.Tensor,
    behav: torch.Tensor,
    mask: torch.Tensor,
    index: torch.Tensor | None,
    rs: RejectionSampling,
) -> Rejection:
    """Rejection sampling of the loss tokens `mask [T]` (module docstring); `index [T]`: each token's
    document (needed at `level: sequence`)."""
    log_ratio = prox.detach().float() - behav.detach().float()
    log_ratio = torch.where(torch.isfinite(log_ratio), log_ratio, 0.0)
    if rs.metric == "ratio":
        metric = log_ratio.exp()
    else:
        metric = kl_estimate(prox.detach().float(), behav.detach().float(), rs.metric[3:], clamp=False)  # type: ignore[arg-type]
    weight = original = log_ratio.exp()
    low = rs.lower if rs.lower is not None else 0.0
    if rs.level == "sequence":
        assert index is not None, "level: sequence needs each token's document"
        n_docs = int(index.max()) + 1 if index.numel() else 0
        in_log = rs.metric == "ratio"
        values = torch.where(mask, log_ratio if in_log else metric, 0.0)
        counts = torch.zeros(n_docs, device=mask.device).index_add_(0, index, mask.float())
        sums = torch.zeros(n_docs, device=mask.device).index_add_(0, index, values)
        if in_log:
            weight = original = (sums / counts.clamp(min=1)).exp()[index]
        if rs.agg == "sum":
            agg = sums
        elif rs.agg == "mean":
            agg = sums / counts.clamp(min=1)
        else:
            masked = torch.where(mask, log_ratio if in_log else metric, -math.inf)
            agg = torch.full((n_docs,), -math.inf, device=mask.device).scatter_reduce(
                0, index, masked, "amax"
            )
            agg = torch.where(counts == 0, 0.0, agg)
        seq_metric = agg.exp() if in_log else agg
        in_bounds = _in_bounds(seq_metric, rs)[index]
        if rs.action == "clamp":
            weight = torch.where(in_bounds, weight, weight.clamp(low, rs.upper))
    elif rs.action == "mask":
        in_bounds = _in_bounds(metric, rs)
    else:
        in_bounds = torch.ones_like(mask)
        weight = weight.clamp(low, rs.upper)
    if rs.action == "mask":
        keep, filtered = mask & in_bounds, mask & ~in_bounds
    else:
        keep, filtered = mask, mask & (original != weight)
    return Rejection(keep, torch.where(keep, weight, 0.0), filtered)


def _in_bounds(metric: torch.Tensor, rs: RejectionSampling) -> torch.Tensor:
    if rs.lower is None:
        return metric <= rs.upper
    return (metric >= rs.lower) & (metric <= rs.upper)


def m2po_keep(behav: torch.Tensor, prox: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """M2PO's loss mask: of the loss tokens, those with the largest second moment
    `m_t = (log pi_behav - log pi_prox)^2` leave, the largest first, until the mean of the rest is
    below `threshold` (at least one token stays). AReaL 1.0.4 applies it per micro-batch, as here."""
    m2 = (behav.detach() - prox.detach()).float().square()
    selected = m2[mask]
    n = selected.numel()
    if n == 0:
        return mask
    ordered, order = torch.sort(selected, descending=True)
    suffix_means = ordered.flip(0).cumsum(0).flip(0) / torch.arange(
        n, 0, -1, device=m2.device, dtype=m2.dtype
    )
    below = torch.nonzero(suffix_means < threshold)
    drop = int(below[0, 0]) if below.numel() else n - 1  # host sync: the count decides the mask
    kept_sorted = torch.arange(n, device=m2.device) >= drop
    kept = torch.empty_like(kept_sorted).scatter_(0, order, kept_sorted)
    out = torch.zeros_like(mask)
    out[mask] = kept
    return out
