"""The PPO-family loss's settings (`PPOSettings`, `RejectionSampling`): frozen dataclasses that validate
themselves, torch-free so that config validation (`laden.config.validate_rl`) reports their errors.
The loss itself is `laden.rl.objectives`; `ppo_settings_of` maps a config's `actor` section onto them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

ImportanceSamplingLevel = Literal["token", "sequence"]
LossAggMode = Literal["token-mean", "seq-mean-token-mean"]
KLEstimator = Literal["k1", "k2", "k3"]
ProxLogpMethod = Literal["recompute", "loglinear", "metrics"]
PROX_LOGP_METHODS: tuple[str, ...] = ("recompute", "loglinear", "metrics")


class SettingsError(ValueError):
    """Invalid settings; `errors` holds one line per invalid field."""

    def __init__(self, what: str, errors: list[str]) -> None:
        super().__init__(f"invalid {what}:\n  " + "\n  ".join(errors))
        self.errors = errors


RejectionLevel = Literal["token", "sequence"]
RejectionAction = Literal["mask", "clamp"]
RejectionMetric = Literal["ratio", "kl_k1", "kl_k2", "kl_k3"]
RejectionAgg = Literal["sum", "mean", "max"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RejectionSampling:
    """AReaL 1.0.4's `actor.rejection_sampling` (its fields, names and defaults)."""

    level: RejectionLevel = "token"
    action: RejectionAction = "mask"
    metric: RejectionMetric = "ratio"
    agg: RejectionAgg = "mean"
    upper: float = 5.0
    lower: float | None = None

    def __post_init__(self) -> None:
        errors = self.errors()
        if errors:
            raise SettingsError("rejection sampling", errors)

    def errors(self, prefix: str = "actor.rejection_sampling") -> list[str]:
        """Every invalid field as `<prefix>.<field>=<value> <reason>; <fix>` (empty when valid)."""
        errors = []
        for name, choices in (
            ("level", ("token", "sequence")),
            ("action", ("mask", "clamp")),
            ("metric", ("ratio", "kl_k1", "kl_k2", "kl_k3")),
            ("agg", ("sum", "mean", "max")),
        ):
            value = getattr(self, name)
            if value not in choices:
                errors.append(f"{prefix}.{name}={value!r} is not known; use one of {', '.join(choices)}")
        if not math.isfinite(self.upper):
            errors.append(f"{prefix}.upper={self.upper} must be a finite number; use e.g. 5.0")
        if self.lower is not None and not self.lower <= self.upper:
            errors.append(
                f"{prefix}.lower={self.lower} is above upper={self.upper}; lower it, or set it to null"
            )
        if self.metric == "ratio" and not self.upper > 1:
            errors.append(
                f"{prefix}.upper={self.upper} must be > 1 with metric ratio (else every token the policies "
                "disagree on is rejected); use e.g. 5.0"
            )
        return errors

    def describe(self) -> str:
        """`token/ratio mask upper 5.0`, as the start-up note shows it."""
        bits = [f"{self.level}/{self.metric}", self.action]
        if self.level == "sequence":
            bits.append(f"agg {self.agg}")
        bits.append(f"upper {self.upper}")
        if self.lower is not None:
            bits.append(f"lower {self.lower}")
        return " ".join(bits)


@dataclass(frozen=True, kw_only=True, slots=True)
class PPOSettings:
    """The PPO-family loss (AReaL's `actor.*` names; defaults AReaL's, but `kl_ctl=0`)."""

    eps_clip: float = 0.2
    """The ratio is clipped to `[1 - eps_clip, 1 + eps_clip_higher]`; 0 only with `m2_threshold` (as AReaL's M2PO)."""
    eps_clip_higher: float | None = None
    """Upper clip (DAPO's clip-higher, e.g. 0.28); None = `eps_clip`."""
    c_clip: float | None = None
    """Dual clip: the loss of a negative advantage is at most `c_clip * |A|`; > 1, None = off."""
    importance_sampling_level: ImportanceSamplingLevel = "token"
    """`token`: a ratio per token (PPO); `sequence`: the sequence's geometric-mean ratio (GSPO)."""
    loss_agg_mode: LossAggMode = "token-mean"
    """`token-mean`: every loss token counts once; `seq-mean-token-mean`: every sequence does."""
    use_decoupled_loss: bool = False
    """Decoupled PPO: ratio against pi_prox, times a behaviour weight (see the module docstring)."""
    rejection_sampling: RejectionSampling | None = None
    """Decoupled only: AReaL 1.0.4's rejection sampling of stale tokens; None = off."""
    apply_behav_imp_weight: bool = True
    """Decoupled without `rejection_sampling`: weight each token by pi_prox / pi_behav (before AReaL 1.0.4);
    False: no behaviour weight (AReaL 1.0.4)."""
    behav_imp_weight_cap: float | None = None
    """Decoupled, before-1.0.4 semantics: tokens whose behaviour weight exceeds this (> 1) get weight 0."""
    m2_threshold: float | None = None
    """M2PO: drop the tokens of largest (log pi_behav - log pi_prox)^2 until the rest's mean is below it."""
    use_sapo_loss: bool = False
    """SAPO's soft sigmoid gates instead of the clip (not with the decoupled loss)."""
    sapo_tau_pos: float = 1.0
    """SAPO's gate temperature for positive advantages (> 0)."""
    sapo_tau_neg: float = 1.05
    """SAPO's gate temperature for negative advantages (> 0)."""
    prox_logp_method: ProxLogpMethod = "recompute"
    """Decoupled: pi_prox `recompute`d, `loglinear`ly approximated, or recomputed with the approximations' `metrics`."""
    kl_ctl: float = 0.0
    """Coefficient of the per-token KL(pi || pi_ref) loss term; 0 = off (no reference model)."""
    kl_estimator: KLEstimator = "k1"
    """`k1`: log r; `k2`: (log r)^2 / 2; `k3`: 1/r - 1 + log r, with r = pi / pi_ref (Schulman)."""
    temperature: float = 1.0
    """Logits are divided by it, as in sampling (`gconfig.temperature`)."""

    def __post_init__(self) -> None:
        errors = self.errors()
        if errors:
            raise SettingsError("PPO settings", errors)

    def errors(self) -> list[str]:
        """Every invalid field as `actor.<field>=<value> <reason>; <fix>` (empty when valid)."""
        errors = []
        low = 0.0 if self.m2_threshold is not None else math.ulp(0.0)  # AReaL's M2PO example: eps_clip 0
        if not low <= self.eps_clip < 1:
            errors.append(
                f"actor.eps_clip={self.eps_clip} must be in (0, 1) (the ratio's lower clip is "
                "1 - eps_clip; [0, 1) with actor.m2_threshold); use 0.2"
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
        errors += _choice("prox_logp_method", self.prox_logp_method, PROX_LOGP_METHODS)
        errors += self._decoupled_errors() + self._m2po_sapo_errors()
        if not 0 <= self.kl_ctl < math.inf:
            errors.append(
                f"actor.kl_ctl={self.kl_ctl} must be a finite number >= 0; use 0.0 to turn the KL term off"
            )
        if not 0 < self.temperature < math.inf:
            errors.append(
                f"actor.temperature={self.temperature} must be > 0 (the sampling temperature); use 1.0"
            )
        return errors

    def _decoupled_errors(self) -> list[str]:
        errors = []
        cap, rs = self.behav_imp_weight_cap, self.rejection_sampling
        only = "is only read by the decoupled loss; set actor.use_decoupled_loss: true, or"
        if cap is not None and not self.use_decoupled_loss:
            errors.append(f"actor.behav_imp_weight_cap={cap} {only} behav_imp_weight_cap to null")
        if cap is not None and not 1 < cap < math.inf:
            errors.append(f"actor.behav_imp_weight_cap={cap} must be > 1; use e.g. 5.0, or null")
        if rs is not None and not self.use_decoupled_loss:
            errors.append(f"actor.rejection_sampling={rs.describe()!r} {only} rejection_sampling to null")
        if rs is not None and (cap is not None or not self.apply_behav_imp_weight):
            errors.append(
                "actor.rejection_sampling is AReaL 1.0.4's behaviour weight; actor.behav_imp_weight_cap and "
                "actor.apply_behav_imp_weight: false are the weight before 1.0.4: keep one of them"
            )
        if not self.apply_behav_imp_weight and cap is not None:
            errors.append(
                f"actor.behav_imp_weight_cap={cap} caps a weight that actor.apply_behav_imp_weight: false turns "
                "off; remove one of them"
            )
        if self.prox_logp_method != "recompute" and not self.use_decoupled_loss:
            errors.append(
                f"actor.prox_logp_method={self.prox_logp_method!r} {only} prox_logp_method to recompute"
            )
        return errors

    def _m2po_sapo_errors(self) -> list[str]:
        errors = []
        m2 = self.m2_threshold
        if m2 is not None and not 0 < m2 < math.inf:
            errors.append(
                f"actor.m2_threshold={m2} must be > 0; use e.g. 0.04 (AReaL's M2PO example), or null"
            )
        if m2 is not None and not self.use_decoupled_loss:
            errors.append(
                f"actor.m2_threshold={m2} compares pi_behav with pi_prox, which are one policy without the "
                "decoupled loss; set actor.use_decoupled_loss: true, or m2_threshold to null"
            )
        if m2 is not None and self.loss_agg_mode != "token-mean":
            errors.append(
                f"actor.m2_threshold={m2} is AReaL's M2PO, defined on the token mean; set actor.loss_agg_mode: "
                "token-mean, or m2_threshold to null"
            )
        if self.use_sapo_loss:
            for name in ("sapo_tau_pos", "sapo_tau_neg"):
                tau = getattr(self, name)
                if not 0 < tau < math.inf:
                    errors.append(f"actor.{name}={tau} must be > 0 (a sigmoid gate's temperature); use 1.0")
            if self.use_decoupled_loss:
                errors.append(
                    "actor.use_sapo_loss is not defined with the decoupled loss (AReaL refuses it too); set "
                    "actor.use_decoupled_loss: false, or use_sapo_loss: false"
                )
        return errors

    def decoupled_semantics(self) -> str:
        """One line for the start-up log: which decoupled-loss semantics these settings get."""
        if self.use_sapo_loss:
            return (
                f"SAPO loss (tau_pos {self.sapo_tau_pos}, tau_neg {self.sapo_tau_neg}): no behaviour weight"
            )
        if not self.use_decoupled_loss:
            return "PPO loss: not decoupled, no behaviour weight"
        rs, extra = self.rejection_sampling, ""
        if self.m2_threshold is not None:
            extra += f", M2PO m2_threshold {self.m2_threshold}"
        if self.prox_logp_method != "recompute":
            extra += f", prox_logp_method {self.prox_logp_method}"
        if rs is not None:
            return f"decoupled loss: AReaL 1.0.4 semantics (rejection_sampling {rs.describe()}{extra})"
        if not self.apply_behav_imp_weight:
            return (
                f"decoupled loss: AReaL 1.0.4 semantics (no rejection_sampling: no behaviour weight{extra})"
            )
        cap = "uncapped" if self.behav_imp_weight_cap is None else f"cap {self.behav_imp_weight_cap}"
        return f"decoupled loss: pre-1.0.4 semantics (behaviour weight on every token, {cap}{extra})"

    @property
    def clip_high(self) -> float:
        """The upper clip bound, `1 + (eps_clip_higher or eps_clip)`."""
        return 1.0 + (self.eps_clip if self.eps_clip_higher is None else self.eps_clip_higher)

    @property
    def needs_sequences(self) -> bool:
        """Whether the loss reduces over whole sequences (GSPO ratios, sequence-level rejection or averaging)."""
        rs = self.rejection_sampling
        return (
            self.importance_sampling_level == "sequence"
            or self.loss_agg_mode == "seq-mean-token-mean"
            or (rs is not None and rs.level == "sequence")
        )

    @property
    def recomputes_prox(self) -> bool:
        """Whether the trainer recomputes log-probs before the update (AReaL's `should_compute_prox_logp`)."""
        return self.prox_logp_method != "loglinear" if self.use_decoupled_loss else False

    @property
    def reads_versions(self) -> bool:
        """Whether the objective reads the `versions` field (the proximal approximation)."""
        return self.use_decoupled_loss and self.prox_logp_method != "recompute"


def _choice(name: str, value: object, choices: tuple[str, ...]) -> list[str]:
    if value in choices:
        return []
    return [f"actor.{name}={value!r} is not known; use one of {', '.join(choices)}"]


def ppo_settings_of(actor: Any) -> PPOSettings:
    """The `PPOSettings` of a config's `actor` section (every field has an `actor.*` field of that name;
    `actor.rejection_sampling`, a section, becomes `RejectionSampling`)."""
    from dataclasses import asdict, fields

    values = {f.name: getattr(actor, f.name) for f in fields(PPOSettings)}
    rs = values["rejection_sampling"]
    values["rejection_sampling"] = None if rs is None else RejectionSampling(**asdict(rs))
    return PPOSettings(**values)
