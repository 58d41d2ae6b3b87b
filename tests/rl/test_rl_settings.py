"""RL config fields (AReaL's `actor.*` names) reach `PPOSettings` / `AdvantageSettings`; bad ones are named."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
from repo_paths import ROOT

from laden.config import ActorConfig, ConfigError, LadenConfig, dump_config, load_config
from laden.config.schema import NormConfig
from laden.config.usage import fields_without_effect
from laden.rl.advantages import GRPO_NORM, AdvantageSettings, NormSettings
from laden.rl.objectives import PPOSettings
from laden.rl.settings import (
    NOT_YET_IMPLEMENTED,
    advantage_settings,
    check_rl_fields_implemented,
    norm_settings,
    ppo_settings,
)

TINY_MODEL = ROOT / "laden" / "assets" / "tiny"  # config.json: 4 heads, 2 kv
SFT = [f"actor.path={TINY_MODEL}", "train_dataset.path=data.jsonl"]
RL = [*SFT, "train_dataset.type=rl", "gconfig.n_samples=4"]

AREAL_GRPO_ACTOR = """\
gconfig:
  n_samples: 4
  max_new_tokens: 1024
  temperature: 1.0
train_dataset:
  type: rl
  path: data.jsonl
  batch_size: 256
  max_length: 1024
actor:
  path: {model}
  gradient_checkpointing: true
  mb_spec:
    max_tokens_per_mb: 10240
  group_size: 4
  eps_clip: 0.4
  reward_scaling: 10.0
  reward_bias: -0.5
  kl_ctl: 0.0
  ppo_n_minibatches: 1
  recompute_logprob: true
  use_decoupled_loss: true
  behav_imp_weight_cap: 5.0
  reward_norm:
    mean_level: group
    std_level: group
    group_size: 4
  adv_norm:
    mean_level: batch
    std_level: batch
"""
"""The actor part of AReaL's gsm8k GRPO example (its `${gconfig.n_samples}` written out as 4)."""


def _rl(*overrides: str):
    return load_config(None, [*RL, *overrides], job="rl")


def _errors(*overrides: str, job: str = "rl") -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(None, [*(RL if job == "rl" else SFT), *overrides], job=job)  # type: ignore[arg-type]
    return info.value.errors


# ------------------------------------------------------------------ defaults and the mapping


def test_every_settings_field_is_an_actor_field_of_the_same_name():
    actor = {f.name for f in dataclasses.fields(ActorConfig)}
    assert {f.name for f in dataclasses.fields(PPOSettings)} <= actor
    assert {f.name for f in dataclasses.fields(AdvantageSettings)} <= actor
    assert {f.name for f in dataclasses.fields(NormSettings)} | {"group_size"} == {
        f.name for f in dataclasses.fields(NormConfig)
    }


def test_defaults_map_to_the_settings_defaults():
    cfg = LadenConfig()
    assert ppo_settings(cfg) == PPOSettings()
    assert norm_settings(NormConfig()) == NormSettings()
    assert norm_settings(None) is None
    adv = advantage_settings(cfg)
    assert adv.adv_norm == GRPO_NORM  # laden's default: GRPO's group mean and std
    assert dataclasses.replace(adv, adv_norm=None) == AdvantageSettings()  # everything else as AReaL


def test_defaults_the_loader_builds_equal_the_dataclass_defaults():
    cfg = _rl()
    assert ppo_settings(cfg) == ppo_settings(LadenConfig())
    assert advantage_settings(cfg) == advantage_settings(LadenConfig())
    assert cfg.reward_fn == "laden.rl.rewards:math_reward"
    assert cfg.workflow == "laden.rl.workflow:RLVRWorkflow"
    assert (cfg.reward_timeout_s, cfg.reward_workers) == (30.0, 2)


# ------------------------------------------------------------------ overrides reach the settings


def test_ppo_overrides_reach_ppo_settings():
    cfg = _rl(
        "actor.eps_clip=0.3",
        "actor.eps_clip_higher=0.28",
        "actor.c_clip=3",
        "actor.importance_sampling_level=sequence",
        "actor.loss_agg_mode=seq-mean-token-mean",
        "actor.use_decoupled_loss=true",
        "actor.behav_imp_weight_cap=5",
        "actor.kl_ctl=0.1",
        "actor.kl_estimator=k3",
        "actor.temperature=0.7",
        "gconfig.temperature=0.7",
    )
    assert ppo_settings(cfg) == PPOSettings(
        eps_clip=0.3,
        eps_clip_higher=0.28,
        c_clip=3.0,
        importance_sampling_level="sequence",
        loss_agg_mode="seq-mean-token-mean",
        use_decoupled_loss=True,
        behav_imp_weight_cap=5.0,
        kl_ctl=0.1,
        kl_estimator="k3",
        temperature=0.7,
    )


def test_advantage_overrides_reach_advantage_settings():
    cfg = _rl(
        "actor.reward_scaling=10",
        "actor.reward_bias=-0.5",
        "actor.reward_clip=5",
        "actor.reward_norm={mean_level: group, std_level: null, mean_leave1out: true}",
        "actor.adv_norm=null",
        "actor.mask_no_eos_with_zero=true",
        "actor.overlong_reward_penalty=true",
        "actor.overlong_tokens=64",
        "actor.overlong_penalty_factor=1",
    )
    assert advantage_settings(cfg) == AdvantageSettings(
        reward_scaling=10.0,
        reward_bias=-0.5,
        reward_clip=5.0,
        reward_norm=NormSettings(mean_level="group", std_level=None, mean_leave1out=True),
        adv_norm=None,
        mask_no_eos_with_zero=True,
        overlong_reward_penalty=True,
        overlong_tokens=64,
        overlong_penalty_factor=1.0,
    )


def test_a_norm_mapping_starts_from_norm_config_defaults():
    # A mapping (or one dotted key) builds a NormConfig: keys left out take AReaL's batch defaults.
    adv = advantage_settings(_rl("actor.adv_norm.mean_level=group"))
    assert adv.adv_norm == NormSettings(mean_level="group", std_level="batch")
    assert advantage_settings(_rl("actor.reward_norm=null")).reward_norm is None
    assert advantage_settings(_rl("actor.reward_norm.std_level=group")).reward_norm == NormSettings(
        std_level="group"
    )


def test_arealike_grpo_yaml_sets_the_fields(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text(AREAL_GRPO_ACTOR.format(model=TINY_MODEL))
    cfg = load_config(path, job="rl")
    assert ppo_settings(cfg) == PPOSettings(eps_clip=0.4, use_decoupled_loss=True, behav_imp_weight_cap=5.0)
    assert advantage_settings(cfg) == AdvantageSettings(
        reward_scaling=10.0, reward_bias=-0.5, reward_norm=GRPO_NORM, adv_norm=NormSettings()
    )
    assert cfg.actor.recompute_logprob and cfg.actor.group_size == 4
    assert load_config(dump_config(cfg, tmp_path / "again.yaml"), job="rl") == cfg


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("actor.eps_clip=1", "actor.eps_clip=1.0 must be in (0, 1)"),
        ("actor.eps_clip=0", "actor.eps_clip=0.0 must be in (0, 1)"),
        ("actor.eps_clip_higher=0", "actor.eps_clip_higher=0.0 must be a finite number greater than 0"),
        ("actor.c_clip=1", "actor.c_clip=1.0 must be a finite number greater than 1"),
        ("actor.ppo_n_minibatches=0", "actor.ppo_n_minibatches=0 must be at least 1"),
        ("actor.group_size=0", "actor.group_size=0 must be at least 1"),
        ("actor.temperature=0", "actor.temperature=0.0 must be a finite number greater than 0"),
        ("actor.reward_scaling=.inf", "actor.reward_scaling=inf must be a finite number"),
        ("actor.reward_clip=0", "actor.reward_clip=0.0 must be greater than 0"),
        ("actor.kl_ctl=-0.1", "actor.kl_ctl=-0.1 must be a finite number >= 0"),
        ("actor.discount=1.5", "actor.discount=1.5 must be in [0, 1]"),
        ("actor.adv_norm.eps=-1", "actor.adv_norm.eps=-1.0 must be a finite number >= 0"),
        ("reward_timeout_s=0", "reward_timeout_s=0.0 must be greater than 0"),
        ("reward_workers=0", "reward_workers=0 must be at least 1"),
        ("actor.loss_agg_mode=seq-mean", "actor.loss_agg_mode='seq-mean': expected one of 'token-mean'"),
        ("actor.importance_sampling_level=seq", "actor.importance_sampling_level='seq': expected one of"),
        ("actor.kl_estimator=k4", "actor.kl_estimator='k4': expected one of 'k1', 'k2', 'k3'"),
        ("actor.adv_norm.mean_level=prompt", "actor.adv_norm.mean_level='prompt': expected one of"),
        ("actor.behav_imp_weight_cap=5", "actor.behav_imp_weight_cap=5.0 is only read by the decoupled loss"),
        ("reward_fn=math reward", "reward_fn='math reward' is not an import path"),
        ("workflow=RLVRWorkflow", "workflow='RLVRWorkflow' is not an import path"),
        ("actor.group_size=8", "actor.group_size=8 does not match gconfig.n_samples=4"),
        (
            "actor.reward_norm.group_size=2",
            "actor.reward_norm.group_size=2 does not match gconfig.n_samples=4",
        ),
    ],
)
def test_bad_rl_fields_are_named_with_a_fix(override, expected):
    (error,) = _errors(override)
    assert expected in error
    assert "; " in error  # the fix follows the reason


def test_overlong_fields_are_required_together():
    errors = _errors("actor.overlong_reward_penalty=true")
    assert len(errors) == 2
    assert errors[0].startswith(
        "actor.overlong_tokens=null is required by actor.overlong_reward_penalty=true"
    )
    assert errors[1].startswith("actor.overlong_penalty_factor=null is required by")
    (error,) = _errors(
        "actor.overlong_reward_penalty=true", "actor.overlong_tokens=512", "actor.overlong_penalty_factor=1",
        "gconfig.max_new_tokens=256",
    )  # fmt: skip
    assert error.startswith("actor.overlong_tokens=512 is larger than gconfig.max_new_tokens=256")
    with pytest.warns(UserWarning, match=r"actor\.\{overlong_tokens\} are ignored"):
        _rl("actor.overlong_tokens=64")


def test_dynamic_sampling_needs_groups_of_two():
    (error,) = _errors(
        "actor.dynamic_sampling=true", "gconfig.n_samples=1", "actor.adv_norm.mean_level=batch"
    )
    assert error.startswith("actor.dynamic_sampling=true with gconfig.n_samples=1 drops every group")


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("actor.importance_sampling_level=sequence", "actor.importance_sampling_level='sequence'"),
        ("actor.loss_agg_mode=seq-mean-token-mean", "actor.loss_agg_mode='seq-mean-token-mean'"),
        ("actor.rejection_sampling={level: sequence}", "actor.rejection_sampling.level='sequence'"),
        ("actor.m2_threshold=0.04", "actor.m2_threshold=0.04"),
    ],
)
def test_sequence_level_modes_refuse_context_parallelism(override, field):
    cp = ["actor.backend=fsdp:d1c2", "cluster.n_gpus_per_node=2"]
    decoupled = ["actor.use_decoupled_loss=true"] if "rejection" in override or "m2" in override else []
    (error,) = _errors(*cp, *decoupled, override)
    assert error.startswith(field) and "actor.backend='fsdp:d1c2' splits" in error
    assert "c=1" in error
    _rl(*cp)  # token level with c=2 is fine
    _rl(*decoupled, override)  # and the sequence level with c=1


def test_rl_settings_warn_where_they_would_silently_hurt():
    with pytest.warns(UserWarning, match=r"actor.temperature=1.0 differs from gconfig.temperature=0.7"):
        _rl("gconfig.temperature=0.7")
    with pytest.warns(
        UserWarning, match=r"actor.adv_norm subtracts each group's mean, but gconfig.n_samples=1"
    ):
        _rl("gconfig.n_samples=1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _rl()
        _rl("gconfig.n_samples=1", "actor.adv_norm.mean_level=batch")
        load_config(None, [*SFT, "gconfig.temperature=0.7"], job="sft")  # sft reads neither


# ------------------------------------------------------------------ what each job reads


def test_sft_names_set_ppo_fields_as_taking_effect_in_rl():
    cfg = load_config(
        None,
        [*SFT, "actor.eps_clip=0.3", "actor.reward_norm={mean_level: group}", "actor.adv_norm=null",
         "reward_workers=4"],
        job="sft",
    )  # fmt: skip
    lines = fields_without_effect(cfg, job="sft", engine="fsdp")
    assert len(lines) == 4, lines  # one line per changed key: not every key of reward_norm
    assert any(line.startswith("actor.eps_clip=0.3 has no effect in `laden sft`") for line in lines)
    assert all("takes effect in `laden rl`" in line for line in lines)
    assert any(line.startswith("actor.reward_norm.mean_level='group'") for line in lines)
    assert any(line.startswith("actor.adv_norm=None") for line in lines)
    assert any(line.startswith("reward_workers=4") for line in lines)
    rl = load_config(None, [*RL, "actor.eps_clip=0.3", "actor.adv_norm=null", "reward_workers=4"], job="rl")
    assert fields_without_effect(rl, job="rl", engine="fsdp") == []
    assert fields_without_effect(load_config(None, SFT, job="sft"), job="sft", engine="fsdp") == []


def test_gae_fields_without_a_critic_are_listed_when_set():
    assert check_rl_fields_implemented(_rl()) == []
    assert NOT_YET_IMPLEMENTED == ()
    (line,) = check_rl_fields_implemented(_rl("actor.discount=0.99"))
    assert line.startswith("actor.discount=0.99 is ignored without a critic: every token's return is")
    assert "add a critic section" in line and line.endswith("set actor.discount: 1.0")
    assert len(check_rl_fields_implemented(_rl("actor.discount=0.99", "actor.gae_lambda=0.95"))) == 2
    assert check_rl_fields_implemented(_rl("actor.discount=0.99", "actor.gae_lambda=0.95", "critic={}")) == []
    assert check_rl_fields_implemented(_rl("actor.recompute_logprob=true")) == []  # the trainer does it
