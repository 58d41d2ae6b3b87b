"""Sections of the RL loss in the config tree: `actor.rejection_sampling` (AReaL 1.0.4's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True, slots=True)
class RejectionSamplingConfig:
    """Rejection sampling of stale tokens in the decoupled loss (AReaL 1.0.4's `actor.rejection_sampling`): the
    proximal and behaviour policies' divergence decides which tokens leave the loss or get a clamped weight."""

    level: Literal["token", "sequence"] = "token"
    """`token`: each token judged alone; `sequence`: every token of a sequence shares its sequence's fate (with
    `metric: ratio` its behaviour weight is the sequence's geometric-mean ratio too)."""
    action: Literal["mask", "clamp"] = "mask"
    """`mask`: out-of-bounds tokens leave the loss; `clamp`: they stay, their behaviour weight clamped to
    `[lower or 0, upper]`."""
    metric: Literal["ratio", "kl_k1", "kl_k2", "kl_k3"] = "ratio"
    """Divergence per token with d = log pi_prox - log pi_behav: `ratio` exp(d), `kl_k1` d, `kl_k2` d^2 / 2,
    `kl_k3` exp(-d) - 1 + d."""
    agg: Literal["sum", "mean", "max"] = "mean"
    """`level: sequence` only: a sequence's value from its tokens' (for `ratio` in log space: `mean` is the
    geometric mean, `sum` the product)."""
    upper: float = 5.0
    """Values above it are out of bounds; > 1 with `metric: ratio`."""
    lower: float | None = None
    """Values below it are out of bounds; null = no lower bound."""
