"""AReaL 1.0.4's losses in `PPOObjective` against a reference written here from AReaL's definitions.

`areal_loss` is AReaL 1.0.4's `grpo_loss_fn` on one packed micro-batch in fp64 from full logits,
written out token by token and document by document (Python loops over plain lists where AReaL
vectorises): the proximal log-probs (recomputed, or the log-linear approximation from versions),
M2PO's token filter (drop the largest second moment while the mean of the rest is at or above the
threshold), rejection sampling (token / sequence level, mask / clamp, the ratio and the three KL
metrics, sum / mean / max, upper / lower), the ratio over the tokens kept (GSPO's sequence means
too), clip, dual clip, SAPO's gates, the behaviour weight, and the mean over the micro-batch's
M2PO-kept tokens. `PPOObjective` (fp32 log-softmax) must give the same loss and the same gradients
wrt the hidden states and the head weight, divided by its normalizer; its statistics must be
AReaL's; and so must each training engine (fsdp, roundpipe, archon) on a tiny model.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import pytest
import torch
from protocol_reference import protocol_engine
from repo_paths import ASSETS
from tiny import tiny_qwen3_config

from laden.config import ConfigError, load_config
from laden.config.ppo_settings import SettingsError
from laden.data.batch import IGNORE_INDEX, PackedBatch, pack_samples
from laden.rl import PPOObjective, PPOSettings
from laden.rl.objectives import RejectionSampling as RS

pytestmark = pytest.mark.usefixtures("one_thread")

V, H = 13, 8
TINY = ASSETS / "tiny"
VERSION = 3  # the weights being trained; tokens come from versions -1 (not generated) .. 3

# ------------------------------------------------------------------ reference (AReaL 1.0.4, fp64)


def _metric(d: float, metric: str) -> float:
    return {"ratio": math.exp(d), "kl_k1": d, "kl_k2": d * d / 2, "kl_k3": math.exp(-d) - 1 + d}[metric]


def _in_bounds(value: float, rs: RS) -> bool:
    return value <= rs.upper and (rs.lower is None or value >= rs.lower)


def _m2po(m2: dict[int, float], threshold: float) -> set[int]:
    kept = set(m2)
    while len(kept) > 1 and sum(m2[i] for i in kept) / len(kept) >= threshold:
        kept.remove(max(kept, key=m2.__getitem__))
    return kept


def _rejection(
    d: dict[int, float], docs: list[list[int]], rs: RS
) -> tuple[set[int], dict[int, float], set[int]]:
    """(tokens kept, behaviour weight per kept token, tokens filtered) of the tokens `d` (d = log prox - log behav)."""
    keep, weight, filtered = set(), {}, set()
    low = 0.0 if rs.lower is None else rs.lower
    for doc in docs:
        toks = [i for i in doc if i in d]
        if not toks:
            continue
        if rs.level == "token":
            for i in toks:
                w = math.exp(d[i])
                if rs.action == "mask":
                    if _in_bounds(_metric(d[i], rs.metric), rs):
                        keep.add(i)
                        weight[i] = w
                    else:
                        filtered.add(i)
                else:
                    keep.add(i)
                    weight[i] = min(max(w, low), rs.upper)
                    if weight[i] != w:
                        filtered.add(i)
            continue
        if rs.metric == "ratio":  # in log space, and the weight is the geometric mean
            logs = [d[i] for i in toks]
            agg = {"sum": sum(logs), "mean": sum(logs) / len(logs), "max": max(logs)}[rs.agg]
            value, w_of = math.exp(agg), {i: math.exp(sum(logs) / len(logs)) for i in toks}
        else:
            values = [_metric(d[i], rs.metric) for i in toks]
            value = {"sum": sum(values), "mean": sum(values) / len(values), "max": max(values)}[rs.agg]
            w_of = {i: math.exp(d[i]) for i in toks}
        inside = _in_bounds(value, rs)
        for i in toks:
            if rs.action == "mask" and not inside:
                filtered.add(i)
            elif rs.action == "mask" or inside:
                keep.add(i)
                weight[i] = w_of[i]
            else:
                keep.add(i)
                weight[i] = min(max(w_of[i], low), rs.upper)
                if weight[i] != w_of[i]:
                    filtered.add(i)
    return keep, weight, filtered


def areal_loss(
    logp: torch.Tensor, batch: PackedBatch, s: PPOSettings, version: int = VERSION
) -> torch.Tensor:
    """AReaL 1.0.4's loss of one micro-batch (a token mean) from the current log-probs `logp [T]` (fp64)."""
    f = {k: v.double().tolist() for k, v in batch.fields.items()}
    bounds = batch.cu_seqlens.tolist()
    docs = [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]
    tokens = [i for i in range(batch.num_tokens) if batch.labels[i] != IGNORE_INDEX]
    behav = f["old_logprobs"]
    lp_const = logp.detach().tolist()
    if not s.use_decoupled_loss:
        prox = behav
    elif s.prox_logp_method == "loglinear":
        prox = list(behav)
        for i in tokens:
            v = f["versions"][i]
            alpha = min(max((version - 1 - v) / (version - v), 0.0), 1.0) if v >= 0 and version > v else 0.0
            prox[i] = behav[i] + alpha * (lp_const[i] - behav[i])
    else:
        prox = f["prox_logprobs"]
    if s.m2_threshold is not None:
        tokens = sorted(_m2po({i: (behav[i] - prox[i]) ** 2 for i in tokens}, s.m2_threshold))
    n_valid = max(len(tokens), 1)
    rs = s.rejection_sampling
    if rs is not None:
        keep, weight, _ = _rejection({i: prox[i] - behav[i] for i in tokens}, docs, rs)
    else:
        keep, weight = set(tokens), {}
    if s.use_decoupled_loss and rs is None and s.apply_behav_imp_weight:  # before 1.0.4
        for i in keep:
            w = math.exp(prox[i] - behav[i])
            weight[i] = 0.0 if s.behav_imp_weight_cap is not None and w > s.behav_imp_weight_cap else w
    total = logp.new_zeros(())
    for doc in docs:
        toks = [i for i in doc if i in keep]
        if not toks:
            continue
        log_ratios = [logp[i] - prox[i] for i in toks]
        advs = [f["advantages"][i] for i in toks]
        if s.importance_sampling_level == "sequence":
            ratios = [torch.exp(sum(log_ratios) / len(toks))] * len(toks)
            advs = [sum(advs) / len(toks)] * len(toks)
        else:
            ratios = [torch.exp(x) for x in log_ratios]
        for i, r, a in zip(toks, ratios, advs):
            if s.use_sapo_loss:
                tau = s.sapo_tau_pos if a > 0 else s.sapo_tau_neg
                loss = -(4 / tau) * torch.sigmoid(tau * (r - 1)) * a
            else:
                loss = torch.maximum(-a * r, -a * r.clamp(1 - s.eps_clip, s.clip_high))
                if s.c_clip is not None and a < 0:
                    loss = torch.minimum(loss, torch.tensor(-s.c_clip * a, dtype=loss.dtype))
            if weight:
                loss = loss * weight[i]
            if s.kl_ctl:
                dk = logp[i] - f["ref_logprobs"][i]
                kl = {"k1": dk, "k2": dk**2 / 2, "k3": torch.exp(-dk) - 1 + dk}[s.kl_estimator]
                loss = loss + s.kl_ctl * kl.clamp(-10, 10)
            total = total + loss
    return total / n_valid


# ------------------------------------------------------------------ problems


def problem(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, PackedBatch]:
    """(hidden [T, H], head weight [V, H], batch) in fp64: six documents (one without loss tokens) with
    behaviour, proximal and reference log-probs spread so that every bound binds on some tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths, prompts = [7, 5, 9, 3, 6, 8], [2, 1, 3, 3, 0, 2]
    samples = [
        (torch.randint(0, V, (n,), generator=g).tolist(), [0] * p + [1] * (n - p))
        for n, p in zip(lengths, prompts)
    ]
    batch = pack_samples(samples, pad_to_multiple_of=8)
    hidden = torch.randn(batch.num_tokens, H, generator=g, dtype=torch.float64)
    weight = 0.5 * torch.randn(V, H, generator=g, dtype=torch.float64)
    return hidden, weight, with_fields(batch, _logp(hidden @ weight.T, batch), seed)


def _logp(logits: torch.Tensor, batch: PackedBatch, temperature: float = 1.0) -> torch.Tensor:
    logp = torch.log_softmax(logits / temperature, -1).gather(1, batch.labels.clamp(min=0)[:, None])[:, 0]
    return torch.where(batch.labels != IGNORE_INDEX, logp, 0.0)


def with_fields(batch: PackedBatch, logp: torch.Tensor, seed: int) -> PackedBatch:
    g = torch.Generator().manual_seed(seed + 100)
    mask = batch.labels != IGNORE_INDEX

    def field(values: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, values, 0.0).float()

    def noise() -> torch.Tensor:
        return torch.randn(batch.num_tokens, generator=g, dtype=torch.float64)

    logp = logp.detach()
    prox = logp + 0.25 * noise()
    return batch.with_fields(
        advantages=field(noise()),
        prox_logprobs=field(prox),
        old_logprobs=field(prox + 0.45 * noise()),
        ref_logprobs=field(logp + 0.5 * noise()),
        versions=field(torch.randint(-1, VERSION + 1, (batch.num_tokens,), generator=g).double()),
    )


def D(**kw) -> PPOSettings:
    return PPOSettings(use_decoupled_loss=True, **kw)


CASES = {
    "rs_token_mask": D(rejection_sampling=RS(upper=1.5)),
    "rs_token_mask_lower": D(rejection_sampling=RS(upper=1.5, lower=0.7)),
    "rs_token_clamp": D(rejection_sampling=RS(action="clamp", upper=1.5, lower=0.7)),
    "rs_seq_mask_mean": D(rejection_sampling=RS(level="sequence", upper=1.15)),
    "rs_seq_mask_max": D(rejection_sampling=RS(level="sequence", agg="max", upper=1.6)),
    "rs_seq_clamp_sum": D(
        rejection_sampling=RS(level="sequence", action="clamp", agg="sum", upper=1.1, lower=0.9)
    ),
    "rs_kl_k1_token": D(rejection_sampling=RS(metric="kl_k1", upper=0.3, lower=-0.3)),
    "rs_kl_k2_seq_mean": D(rejection_sampling=RS(level="sequence", metric="kl_k2", upper=0.1)),
    "rs_kl_k3_seq_max_clamp": D(
        rejection_sampling=RS(level="sequence", action="clamp", metric="kl_k3", agg="max", upper=0.2)
    ),
    "gspo_rs_token_mask": D(
        importance_sampling_level="sequence", eps_clip=0.1, rejection_sampling=RS(upper=1.5)
    ),
    "gspo_rs_token_clamp": D(
        importance_sampling_level="sequence", eps_clip=0.1, rejection_sampling=RS(action="clamp", upper=1.5)
    ),  # fmt: skip
    "dual_clip_kl_rs": D(
        c_clip=1.5, eps_clip_higher=0.28, kl_ctl=0.1, kl_estimator="k3", rejection_sampling=RS(upper=1.5)
    ),  # fmt: skip
    "no_behaviour_weight": D(apply_behav_imp_weight=False),
    "pre_1_0_4_cap": D(behav_imp_weight_cap=1.5),
    "m2po": D(m2_threshold=0.1, eps_clip=0.0, rejection_sampling=RS(upper=5.0)),
    "m2po_gspo_masked": D(
        m2_threshold=0.1, importance_sampling_level="sequence", rejection_sampling=RS(upper=1.5)
    ),
    "m2po_keeps_one": D(m2_threshold=1e-9),
    "sapo": PPOSettings(use_sapo_loss=True),
    "sapo_sequence": PPOSettings(use_sapo_loss=True, importance_sampling_level="sequence", sapo_tau_neg=2.0),
    "loglinear": D(prox_logp_method="loglinear", rejection_sampling=RS(upper=1.5)),
    "metrics": D(prox_logp_method="metrics", rejection_sampling=RS(upper=1.5)),
}


def loss_and_grads(fn, hidden: torch.Tensor, weight: torch.Tensor):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w)
    return (loss.detach(), *torch.autograd.grad(loss, (h, w)))


def _objective(settings: PPOSettings, chunk_size: int = 1024) -> PPOObjective:
    objective = PPOObjective(settings, chunk_size=chunk_size)
    objective.version = VERSION
    return objective


# ------------------------------------------------------------------ the objective


@pytest.mark.parametrize("chunk_size", [3, 1024], ids=["chunked", "one_chunk"])
@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_grads_equal_areal(case: str, chunk_size: int):
    hidden, weight, batch = problem()
    settings = CASES[case]
    objective = _objective(settings, chunk_size)
    n = batch.num_loss_tokens
    got = loss_and_grads(lambda h, w: objective(h.float(), w.float(), batch).double() / n, hidden, weight)
    want = loss_and_grads(lambda h, w: areal_loss(_logp(h @ w.T, batch), batch, settings), hidden, weight)
    for name, g, r in zip(("loss", "grad_hidden", "grad_weight"), got, want):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=name)
    assert got[1].abs().sum() > 0 and got[2].abs().sum() > 0


def test_each_case_filters_some_tokens_but_not_all():
    """The data make each bound bind on some tokens but not on all, so both sides are exercised."""
    _, _, batch = problem()
    f = {k: v.double().tolist() for k, v in batch.fields.items()}
    tokens = [i for i in range(batch.num_tokens) if batch.labels[i] != IGNORE_INDEX]
    bounds = batch.cu_seqlens.tolist()
    docs = [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]
    d = {i: f["prox_logprobs"][i] - f["old_logprobs"][i] for i in tokens}
    for case, s in CASES.items():
        if s.rejection_sampling is not None and s.m2_threshold is None:
            _, _, filtered = _rejection(d, docs, s.rejection_sampling)
            assert 0 < len(filtered) < len(tokens), case
    m2 = {i: d[i] ** 2 for i in tokens}
    assert 0 < len(_m2po(m2, 0.1)) < len(tokens)
    assert len(_m2po(m2, 1e-9)) == 1  # no suffix mean is below it: all tokens but one leave


def test_statistics_are_arealss_on_the_tokens_rejection_keeps():
    """importance_weight and clip_fraction over the loss tokens with rejected tokens at 0, behav_imp_weight
    over the kept tokens (AReaL 1.0.4's denominators)."""
    hidden, weight, batch = problem()
    rs = RS(upper=1.5)
    objective = _objective(D(rejection_sampling=rs))
    objective(hidden.float(), weight.float(), batch)
    stats = objective.last_stats
    mask = batch.labels != IGNORE_INDEX
    logp = _logp(hidden @ weight.T, batch)
    prox, behav = batch.fields["prox_logprobs"].double(), batch.fields["old_logprobs"].double()
    w = (prox - behav).exp()
    keep = mask & (w <= rs.upper)
    ratio = torch.where(keep, (logp - prox).exp(), 0.0)
    adv = batch.fields["advantages"].double()
    clipped = keep & ((-adv * ratio) < (-adv * ratio.clamp(0.8, 1.2)))
    n = mask.sum()
    want = {
        "importance_weight": ratio[mask].sum() / n,
        "clip_fraction": clipped.sum() / n,
        "approx_kl": (logp - prox)[mask].sum() / n,
        "behav_imp_weight": w[keep].mean(),
        "behave_approx_kl": (prox - behav)[keep].mean(),
        "rs_filtered_fraction": (mask & ~keep).sum() / n,
        "compute_logp/kl_div_taylor": ((logp - behav)[keep] ** 2 / 2).mean(),
    }
    for name, value in want.items():
        torch.testing.assert_close(stats[name].double(), value.double(), rtol=1e-5, atol=1e-6, msg=name)
    assert 0 < stats["rs_filtered_fraction"] < 1


def test_metrics_logs_the_approximations_errors_against_the_recompute():
    hidden, weight, batch = problem()
    objective = _objective(D(prox_logp_method="metrics"))
    objective(hidden.float(), weight.float(), batch)
    stats = objective.last_stats
    mask = batch.labels != IGNORE_INDEX
    logp = _logp(hidden @ weight.T, batch).detach()
    prox, behav = batch.fields["prox_logprobs"].double(), batch.fields["old_logprobs"].double()
    v = batch.fields["versions"].double()
    alpha = torch.where((v >= 0) & (v < VERSION), (VERSION - 1 - v) / (VERSION - v), 0.0).clamp(0, 1)
    loglinear = behav + alpha * (logp - behav)
    linear = torch.log((1 - alpha) * behav.exp() + alpha * logp.exp() + 1e-10)
    for name, approx in (("loglinear", loglinear), ("linear", linear), ("rollout", behav)):
        abs_error = (prox - approx).abs()[mask].mean()
        torch.testing.assert_close(
            stats[f"compute_logp/{name}/abs_error"].double(), abs_error, rtol=1e-5, atol=1e-6
        )
    assert stats["compute_logp/rollout/abs_error"] > stats["compute_logp/loglinear/abs_error"] > 0


def test_settings_refuse_what_areal_refuses_or_cannot_mean():
    cases = {
        "actor.eps_clip=0.0 must be in (0, 1)": dict(eps_clip=0.0),
        "actor.use_sapo_loss is not defined with the decoupled loss": dict(use_sapo_loss=True, use_decoupled_loss=True),
        "actor.sapo_tau_neg=0.0 must be > 0": dict(use_sapo_loss=True, sapo_tau_neg=0.0),
        "actor.m2_threshold=0.04 compares pi_behav with pi_prox": dict(m2_threshold=0.04),
        "actor.rejection_sampling='token/ratio mask upper 5.0' is only read by the decoupled loss": dict(
            rejection_sampling=RS()
        ),
        "actor.rejection_sampling is AReaL 1.0.4's behaviour weight": dict(
            use_decoupled_loss=True, rejection_sampling=RS(), behav_imp_weight_cap=2.0
        ),
        "actor.prox_logp_method='loglinear' is only read by the decoupled loss": dict(prox_logp_method="loglinear"),
    }  # fmt: skip
    for message, fields in cases.items():
        with pytest.raises(SettingsError) as info:
            PPOSettings(**fields)
        assert any(e.startswith(message) for e in info.value.errors), (message, info.value.errors)
    PPOSettings(use_decoupled_loss=True, m2_threshold=0.04, eps_clip=0.0)  # AReaL's gsm8k_m2po.yaml
    with pytest.raises(SettingsError, match=r"rejection_sampling.upper=1.0 must be > 1 with metric ratio"):
        RS(upper=1.0)
    with pytest.raises(SettingsError, match=r"lower=2.0 is above upper=1.5"):
        RS(upper=1.5, lower=2.0)
    RS(metric="kl_k2", upper=0.5)  # below 1 is fine for a KL metric


def test_versions_are_read_at_the_input_token_as_areal_reads_them():
    """AReaL 1.0.4 shifts the log-probs and the loss mask to the labels but not `versions`: a label's
    approximation uses the version of the token before it, -1 for the first completion token."""
    from laden.rl.prox_approx import input_token_versions

    assert input_token_versions([4, 4, 5]) == [-1, 4, 4]
    assert input_token_versions([]) == []
    batch = pack_samples(
        [([1, 2, 3, 4], [0, 1, 1, 1])], fields={"versions": [[0.0, *input_token_versions([2, 3, 3])]]}
    )
    assert batch.fields["versions"].tolist()[:3] == [-1.0, 2.0, 3.0]  # labels 2, 3, 4: versions of 1, 2, 3


def test_semantics_note_names_what_a_setting_gets():
    assert D(rejection_sampling=RS()).decoupled_semantics() == (
        "decoupled loss: AReaL 1.0.4 semantics (rejection_sampling token/ratio mask upper 5.0)"
    )
    assert D(apply_behav_imp_weight=False).decoupled_semantics() == (
        "decoupled loss: AReaL 1.0.4 semantics (no rejection_sampling: no behaviour weight)"
    )
    assert D(behav_imp_weight_cap=5.0).decoupled_semantics() == (
        "decoupled loss: pre-1.0.4 semantics (behaviour weight on every token, cap 5.0)"
    )
    assert (
        "M2PO m2_threshold 0.04, prox_logp_method loglinear"
        in D(
            m2_threshold=0.04,
            prox_logp_method="loglinear",
            rejection_sampling=RS(level="sequence", agg="max"),
        ).decoupled_semantics()
    )
    assert PPOSettings(use_sapo_loss=True).decoupled_semantics().startswith("SAPO loss")


# ------------------------------------------------------------------ AReaL's names in a config


def _actor(tmp_path, actor: dict, *overrides: str):
    import yaml

    path = tmp_path / "areal.yaml"
    areal = {"experiment_name": "x", "trial_name": "t", "allocation_mode": "sglang:d1+fsdp:d1",
             "cluster": {"n_gpus_per_node": 2}, "train_dataset": {"path": "train.jsonl", "type": "rl"},
             "actor": {"path": str(TINY), "use_decoupled_loss": True, **actor}}  # fmt: skip
    path.write_text(yaml.safe_dump(areal))
    return load_config(path, list(overrides), job="rl").actor


@pytest.mark.parametrize(
    ("actor", "want"),
    [
        ({}, {"apply_behav_imp_weight": False, "rejection_sampling": None}),  # 1.0.4: no weight by default
        ({"rejection_sampling": None}, {"apply_behav_imp_weight": False}),
        ({"behave_imp_weight_mode": "disabled"}, {"apply_behav_imp_weight": False, "behav_imp_weight_cap": None}),
        ({"behave_imp_weight_mode": "token_mask"}, {"behav_imp_weight_cap": 5.0, "apply_behav_imp_weight": True}),
        ({"behave_imp_weight_cap": 3.0}, {"behav_imp_weight_cap": 3.0, "rejection_sampling": None}),
        ({"behav_imp_weight_cap": 2.0}, {"behav_imp_weight_cap": 2.0, "apply_behav_imp_weight": True}),
        ({"behave_imp_weight_mode": "token_truncate", "behave_imp_weight_cap": 3.0},
         {"rejection_sampling": ("token", "clamp", "ratio", 3.0), "behav_imp_weight_cap": None}),
        ({"behave_imp_weight_mode": "sequence_mask"}, {"rejection_sampling": ("sequence", "mask", "ratio", 5.0)}),
        ({"behave_imp_weight_mode": "sequence_truncate"}, {"rejection_sampling": ("sequence", "clamp", "ratio", 5.0)}),
        ({"rejection_sampling": {"level": "sequence", "metric": "kl_k3", "agg": "max", "upper": 0.5, "lower": 0.01}},
         {"rejection_sampling": ("sequence", "mask", "kl_k3", 0.5), "apply_behav_imp_weight": True}),
    ],
)  # fmt: skip
def test_areal_names_map_to_what_they_meant(tmp_path, actor, want):
    got = _actor(tmp_path, actor)
    for name, value in want.items():
        have = getattr(got, name)
        if isinstance(value, tuple) and have is not None:
            have = (have.level, have.action, have.metric, have.upper)
        assert have == value, name


def test_areal_names_that_cannot_mean_anything_are_errors(tmp_path):
    with pytest.raises(ConfigError) as info:
        _actor(tmp_path, {"behave_imp_weight_mode": "token_clip"})
    assert "actor.behave_imp_weight_mode='token_clip' is not one of AReaL's modes" in str(info.value)
    with pytest.raises(ConfigError) as info:
        _actor(tmp_path, {"behave_imp_weight_cap": 3.0, "rejection_sampling": {"upper": 2.0}})
    assert "both set the decoupled loss's behaviour weight; keep one of them" in str(info.value)


def test_ladens_own_config_keeps_the_weight_and_takes_the_section():
    cfg = load_config(str(ASSETS / "rl_tiny.yaml"), ["actor.use_decoupled_loss=true"], job="rl")
    assert cfg.actor.apply_behav_imp_weight and cfg.actor.rejection_sampling is None
    cfg = load_config(
        str(ASSETS / "rl_tiny.yaml"),
        [
            "actor.use_decoupled_loss=true",
            "actor.rejection_sampling={level: sequence, action: clamp, upper: 2.0}",
        ],
        job="rl",
    )
    assert (cfg.actor.rejection_sampling.level, cfg.actor.rejection_sampling.upper) == ("sequence", 2.0)
    with pytest.raises(ConfigError) as info:
        load_config(str(ASSETS / "rl_tiny.yaml"), ["actor.rejection_sampling={upper: 2.0}"], job="rl")
    assert "actor.rejection_sampling='token/ratio mask upper 2.0' is only read by the decoupled loss" in str(
        info.value
    )


# ------------------------------------------------------------------ on every engine


def _model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_qwen3_config(vocab_size=48), dtype=torch.float32)


def _engine_batches(model) -> list[PackedBatch]:
    g = torch.Generator().manual_seed(7)
    out = []
    for mb in range(2):
        samples = []
        for _ in range(3):
            n = int(torch.randint(5, 10, (1,), generator=g))
            samples.append((torch.randint(4, 48, (n,), generator=g).tolist(), [0] * 2 + [1] * (n - 2)))
        batch = pack_samples(samples)
        with torch.no_grad():
            logp = _logp(_doc_logits(model, batch), batch, 0.7)
        out.append(with_fields(batch, logp, seed=mb))
    return out


def _doc_logits(model, batch: PackedBatch) -> torch.Tensor:
    bounds = batch.cu_seqlens.tolist()
    return torch.cat(
        [model(input_ids=batch.input_ids[a:b][None]).logits[0] for a, b in zip(bounds[:-1], bounds[1:])]
    )


ENGINE_SETTINGS = D(
    importance_sampling_level="sequence", c_clip=2.0, m2_threshold=0.1, prox_logp_method="loglinear",
    rejection_sampling=RS(upper=1.5), temperature=0.7,
)  # fmt: skip


@pytest.mark.parametrize("backend", ["fsdp:d1", "roundpipe:d1", "archon:d1"])
def test_engines_train_areals_loss(backend):
    """Loss and one SGD step through each engine equal AReaL's loss over the micro-batches by autograd
    (AReaL weights each micro-batch's token mean by its loss tokens)."""
    lr = 0.5
    ref = _model()
    batches = _engine_batches(ref)
    total = sum(mb.num_loss_tokens for mb in batches)
    want = (
        sum(
            areal_loss(_logp(_doc_logits(ref, mb).double(), mb, 0.7), mb, ENGINE_SETTINGS)
            * mb.num_loss_tokens
            for mb in batches
        )
        / total
    )
    want.backward()
    engine = protocol_engine(backend, _model(), lr=lr)
    objective = _objective(ENGINE_SETTINGS, chunk_size=5)
    loss = engine.forward_backward(batches, objective, normalizer=objective.loss_normalizer(batches))
    torch.testing.assert_close(float(loss), float(want), rtol=1e-5, atol=1e-6)
    engine.optimizer_step()
    weights = dict(engine.named_weights(torch.float32))
    for name, p in ref.named_parameters():
        torch.testing.assert_close(
            weights[name], p.detach() - lr * p.grad.float(), rtol=1e-5, atol=1e-6, msg=name
        )


def test_the_trainer_logs_which_semantics_a_config_got(caplog):
    from laden.rl.trainer import _Run

    run = object.__new__(_Run)
    run.cfg = load_config(str(ASSETS / "rl_tiny.yaml"), ["actor.use_decoupled_loss=true"], job="rl")
    with caplog.at_level(logging.INFO, logger="laden.rl"):
        objective, _ = run._objective()
    assert "decoupled loss: pre-1.0.4 semantics (behaviour weight on every token, uncapped)" in caplog.text
    assert objective.settings.apply_behav_imp_weight
    assert (
        replace(objective.settings, apply_behav_imp_weight=False)
        .decoupled_semantics()
        .startswith("decoupled loss: AReaL 1.0.4 semantics")
    )
