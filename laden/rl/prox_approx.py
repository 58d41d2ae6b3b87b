"""The proximal policy's log-probs approximated from the behaviour and current ones (AReaL 1.0.4's
`prox_logp_method`), instead of, or beside, the trainer's recompute.

With `v_t` the weight version of token t's input token (-1: not generated; `input_token_versions`,
as AReaL 1.0.4 reads its unshifted `versions` next to shifted log-probs), `v` the version of the
weights being trained and the proximal version `v - 1` (AReaL's), per token
`alpha_t = clamp((v - 1 - v_t) / (v - v_t), 0, 1)` where `v > v_t` and `v_t >= 0`, else 0, and
- `loglinear`: log pi_prox ~ log pi_behav + alpha_t (log pi - log pi_behav);
- `linear`: log pi_prox ~ log((1 - alpha_t) pi_behav + alpha_t pi + 1e-10);
- `rollout`: log pi_prox ~ log pi_behav.
`prox_logp_method: loglinear` trains on the first (no recompute); `metrics` trains on the recompute and
logs each approximation's error against it (`approximation_stats`).
"""

from __future__ import annotations

import torch

from laden.config.ppo_settings import ProxLogpMethod

APPROXIMATIONS: tuple[str, ...] = ("loglinear", "linear", "rollout")
_REL_EPS = 1e-8


def input_token_versions(versions: list[int]) -> list[int]:
    """A completion's `versions` field as AReaL 1.0.4 reads it: at each label the version of the token before
    it (AReaL shifts the log-probs and the loss mask to the labels, not the versions), so the first
    completion token gets -1 (a prompt token's) and hence alpha 0."""
    return [-1, *versions[:-1]] if versions else []


def approximate(
    method: str, behav: torch.Tensor, logp: torch.Tensor, versions: torch.Tensor, version: int
) -> torch.Tensor:
    """The approximation `method` (one of `APPROXIMATIONS`) of log pi_prox per token (module docstring)."""
    v_behav = versions.float()
    gap = float(version) - v_behav
    alpha = torch.where((gap > 0) & (versions >= 0), (gap - 1) / gap.clamp(min=1e-30), 0.0).clamp(0.0, 1.0)
    if method == "loglinear":
        return behav + alpha * (logp - behav)
    if method == "linear":
        return torch.log((1 - alpha) * behav.exp() + alpha * logp.exp() + 1e-10)
    if method == "rollout":
        return behav.clone()
    raise ValueError(f"unknown proximal approximation {method!r}; use one of {', '.join(APPROXIMATIONS)}")


def approximation_stats(
    method: ProxLogpMethod,
    behav: torch.Tensor,
    logp: torch.Tensor,
    versions: torch.Tensor | None,
    version: int,
    recomputed: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """Per-token statistics AReaL 1.0.4 logs under `compute_logp/`: with `loglinear` its approximation
    and the weights it gives; with `metrics` every approximation's, with their errors against the
    recomputed `recomputed` (the approximations need `versions`); and the drift between the trained
    and the behaviour policy."""
    logp = logp.detach()
    out: dict[str, torch.Tensor] = {}
    if recomputed is not None:
        out["prox_logp_gt"] = recomputed
    names = ("loglinear",) if method == "loglinear" else APPROXIMATIONS if method == "metrics" else ()
    for name in () if versions is None else names:
        assert versions is not None
        approx = approximate(name, behav, logp, versions, version)
        behav_w, imp_w = (approx - behav).exp(), (logp - approx).exp()
        out |= {
            f"{name}/approx_logp": approx,
            f"{name}/behave_imp_weight": behav_w,
            f"{name}/importance_weight": imp_w,
        }
        if recomputed is not None:
            for key, truth, value in (
                ("", recomputed, approx),
                ("behave_imp_weight_", (recomputed - behav).exp(), behav_w),
                ("importance_weight_", (logp - recomputed).exp(), imp_w),
            ):
                diff = truth - value
                out[f"{name}/{key}abs_error"] = diff.abs()
                out[f"{name}/{key}rel_error"] = (diff / (truth.abs() + _REL_EPS)).abs()
                if not key:
                    out[f"{name}/squared_error"] = diff.square()
    log_ratio = logp - behav
    out |= {"kl_div_direct": -log_ratio, "kl_div_taylor": log_ratio.square() / 2, "kl_div_dual": torch.expm1(log_ratio) - log_ratio}  # fmt: skip
    return {f"compute_logp/{k}": v for k, v in out.items()}
