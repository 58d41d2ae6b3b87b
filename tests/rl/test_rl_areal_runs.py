"""`laden rl` on the tiny task with AReaL 1.0.4's losses: rejection sampling, M2PO, SAPO and the proximal
log-prob approximation each train a few steps on the CPU and log their statistics."""

from __future__ import annotations

import json
import logging
import math

import pytest
from rl_runs import lockstep, tiny_rl_config

from laden.rl import policy_step
from laden.rl.trainer import run_rl

pytestmark = pytest.mark.usefixtures("one_thread")

ASYNC = [
    "rollout.max_head_offpolicyness=1",
    "actor.use_decoupled_loss=true",
]  # stale tokens: pi_prox != pi_behav
RUNS = {
    "rejection_sampling": (
        [
            *ASYNC,
            "actor.rejection_sampling={level: sequence, action: clamp, metric: kl_k3, agg: max, upper: 0.5}",
        ],
        ["behav_imp_weight", "behave_approx_kl", "rs_filtered_fraction", "clip_fraction"],
        "AReaL 1.0.4 semantics (rejection_sampling sequence/kl_k3 clamp agg max upper 0.5)",
    ),
    "m2po": (
        [*ASYNC, "actor.m2_threshold=0.00001", "actor.eps_clip=0.0", "actor.rejection_sampling={upper: 5.0}"],
        ["m2po_masked_fraction", "rs_filtered_fraction"],
        "M2PO m2_threshold 1e-05",
    ),
    "sapo": (
        ["actor.use_sapo_loss=true", "actor.importance_sampling_level=sequence"],
        ["sapo_soft_gate", "sapo_scaled_gate_pos", "sapo_scaled_gate_neg"],
        "SAPO loss (tau_pos 1.0, tau_neg 1.05)",
    ),
    "loglinear": (
        [*ASYNC, "actor.prox_logp_method=loglinear", "actor.rejection_sampling={upper: 5.0}"],
        ["compute_logp/loglinear/approx_logp", "compute_logp/kl_div_dual"],
        "prox_logp_method loglinear",
    ),
    "metrics": (
        [*ASYNC, "actor.prox_logp_method=metrics", "actor.apply_behav_imp_weight=false"],
        [
            "compute_logp/loglinear/abs_error",
            "compute_logp/linear/abs_error",
            "compute_logp/rollout/abs_error",
        ],
        "AReaL 1.0.4 semantics (no rejection_sampling: no behaviour weight, prox_logp_method metrics)",
    ),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_areal_loss_trains_the_tiny_task(tmp_path, monkeypatch, caplog, name):
    overrides, stats, note = RUNS[name]
    lockstep(monkeypatch)
    recomputes = []
    original = policy_step.score

    def score(engine, mbs, name, **kw):
        recomputes.append(name) if name in ("prox_logprobs", "old_logprobs") else None
        return original(engine, mbs, name, **kw)

    monkeypatch.setattr(policy_step, "score", score)
    with caplog.at_level(logging.INFO, logger="laden.rl"):
        result = run_rl(tiny_rl_config(tmp_path, "total_train_steps=3", *overrides), progress=False)
    assert result.num_steps == 3
    assert any(note in r.getMessage() for r in caplog.records if r.name == "laden.rl"), caplog.text
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] > 0]
    assert len(rows) == 3
    for row in rows:
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]), row
        for stat in stats:
            assert math.isfinite(row[stat]), (stat, row)
    assert any(row["grad_norm"] > 0 for row in rows)  # a step may draw groups of equal rewards only
    # AReaL's should_compute_prox_logp: the log-linear approximation replaces the recompute
    assert bool(recomputes) == (name not in ("loglinear", "sapo")), recomputes
    if name == "m2po":  # the stale steps drop tokens; the first (fresh) one drops none
        assert rows[0]["m2po_masked_fraction"] == 0 and max(r["m2po_masked_fraction"] for r in rows) > 0
