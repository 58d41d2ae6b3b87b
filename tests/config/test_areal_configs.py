"""AReaL's example YAML files load in laden unchanged but for model and dataset paths.

The files under `tests/support/areal_configs/` are copies of AReaL's examples (source and commit in
each file's first lines). Each one loads for its job, its values land in laden's fields, every
AReaL key that laden drops is named in exactly one warning (those that ask for nothing, or
belong to a part of AReaL the run does not use, in none), and keys that are neither laden's nor
AReaL's stay errors. Also here: `${...}` interpolation, Hydra's `+key` / `~key` overrides, and
the allocation modes AReaL accepts.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import yaml
from areal_copies import AREAL, PATHS, TINY_MODEL

from laden.config import AllocationMode, ConfigError, check_alloc, config_from_dict, load_config
from laden.config.alloc import split_areal_allocation
from laden.config.areal_keys import areal_leaf_keys, key_role
from laden.config.loader import all_keys
from laden.config.schema_rl import RejectionSamplingConfig

_RL_COMMON = {
    "rollout.backend": "sglang:d4p1t1",
    "actor.backend": "fsdp:d4p1t1",
    "rollout.max_concurrent_rollouts": 256,
    "rollout.max_head_offpolicyness": 2,
    "gconfig.n_samples": 4,
    "gconfig.max_new_tokens": 1024,
    "train_dataset.batch_size": 256,
    "train_dataset.max_length": 1024,
    "valid_dataset.batch_size": 256,
    "actor.mb_spec.max_tokens_per_mb": 10240,
    "actor.optimizer.lr": 1.7e-5,
    "actor.optimizer.weight_decay": 0.017,
    "actor.optimizer.eps": 1e-8,
    "actor.optimizer.warmup_steps_proportion": 0.001,
    "actor.eps_clip": 0.4,
    "actor.temperature": 1.0,
    "actor.reward_scaling": 10.0,
    "actor.reward_bias": -0.5,
    "actor.use_decoupled_loss": True,
    "actor.rejection_sampling": RejectionSamplingConfig(metric="ratio", upper=5.0),  # AReaL 1.0.4's section
    "actor.apply_behav_imp_weight": True,
    "actor.adv_norm.mean_level": "batch",
    "actor.init_from_config": False,  # actor.init_from_scratch
    "checkpoint.resume": "never",  # recover.mode: disabled
    "checkpoint.save_freq_steps": None,  # saver.freq_steps: null
    "sglang.mem_fraction_static": 0.8,
    "sglang.context_length": 32768,  # passed to the SGLang servers laden starts
    "sglang.max_running_requests": None,
    "vllm.max_model_len": 32768,  # kept in laden's vllm section, read only with rollout.backend: vllm
    "cluster.fileroot": "/tmp/areal/experiments",
    "cluster.n_gpus_per_node": 8,
    "total_train_epochs": 10,
    "evaluator.freq_epochs": 1,  # laden evaluates on valid_dataset as AReaL's evaluator says
}
_LAUNCH = ["cluster.name_resolve", "rollout.scheduling_spec", "actor.scheduling_spec"]
_WORKERS = ["train_dataset.pin_memory", "train_dataset.num_workers", "valid_dataset.pin_memory",
            "valid_dataset.num_workers"]  # fmt: skip
_RL_WARNED = [_LAUNCH, ["rollout.dump_to_file"], ["sglang.skip_tokenizer_init"],
              _WORKERS, ["saver.freq_epochs"]]  # fmt: skip

CASES = {
    "gsm8k_grpo": (
        "rl",
        _RL_COMMON | {"experiment_name": "gsm8k-grpo", "actor.reward_norm.mean_level": "group",
                      "actor.reward_norm.group_size": 4},
        _RL_WARNED,
    ),
    "gsm8k_ppo": (
        "rl",
        _RL_COMMON | {"experiment_name": "gsm8k-ppo", "actor.reward_norm": None, "critic.backend": "fsdp:d4p1t1",
                      "critic.path": str(TINY_MODEL), "critic.init_from_config": False, "critic.dtype": "bfloat16",
                      "critic.eps_clip": 0.5, "critic.ppo_n_minibatches": 1, "critic.mb_spec.max_tokens_per_mb": 10240,
                      "critic.optimizer.lr": 1.7e-5, "critic.optimizer.weight_decay": 0.017},
        [[*_LAUNCH, "critic.scheduling_spec", "critic.scheduling_strategy"], *_RL_WARNED[1:]],
    ),
    "gsm8k_dapo_dynamic_bs": (
        "rl",
        _RL_COMMON | {"rollout.backend": "sglang:d4", "actor.backend": "fsdp:d4", "gconfig.max_new_tokens": 4096,
                      "actor.eps_clip": 0.2, "actor.eps_clip_higher": 0.28, "actor.overlong_reward_penalty": True,
                      "actor.overlong_tokens": 512, "actor.overlong_penalty_factor": 1.0},
        [*_RL_WARNED, ["dynamic_bs"]],
    ),
    "gsm8k_sft": (
        "sft",
        {"experiment_name": "gsm8k-sft", "actor.backend": "fsdp:d8p1t1", "actor.gradient_checkpointing": True,
         "actor.mb_spec.max_tokens_per_mb": 4096, "actor.optimizer.lr": 2e-5, "actor.optimizer.beta2": 0.95,
         "actor.optimizer.eps": 1e-5, "actor.optimizer.lr_scheduler_type": "cosine",
         "train_dataset.batch_size": 128, "train_dataset.type": "sft", "valid_dataset.batch_size": 128,
         "checkpoint.resume": "never", "total_train_epochs": 1},
        [["cluster.name_resolve", "actor.scheduling_spec"], _WORKERS, ["saver.freq_epochs"]],
    ),
    "gsm8k_grpo_2025_11": (  # allocation_mode: sglang.d4p1t1+d4p1t1, actor.backend: fsdp, async_training
        "rl",
        _RL_COMMON | {"actor.group_size": 4, "actor.dynamic_sampling": False, "actor.rejection_sampling": None,
                      "actor.behav_imp_weight_cap": 5.0,  # the name before 1.0.4: its semantics
                      "vllm.max_model_len": None},  # no vllm section
        [["cluster.name_resolve", "launcher"], *_RL_WARNED[2:]],
    ),
}  # fmt: skip


def _value(cfg, dotted):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _areal_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "laden.config.areal"]


def _mentions(message: str, key: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(key)}[.=]", message) is not None


@pytest.mark.parametrize("name", list(CASES))
def test_areal_example_loads_with_its_values_in_ladens_fields(name, caplog):
    job, expected, warned = CASES[name]
    with caplog.at_level(logging.WARNING, logger="laden.config.areal"):
        cfg = load_config(AREAL / f"{name}.yaml", PATHS, job=job)
    for dotted, value in expected.items():
        assert _value(cfg, dotted) == value, dotted
    assert cfg.actor.path == str(TINY_MODEL)
    messages = _areal_warnings(caplog)
    assert len(messages) == len(warned), messages
    for keys in warned:
        for key in keys:
            assert sum(_mentions(m, key) for m in messages) == 1, (key, messages)
    assert all(
        "without effect in laden; laden" in m or "without effect in laden; every" in m for m in messages
    )
    silent = ["ref", "vllm", "stats_logger", "perf_tracer", "scheduler", "enable_offload", "recover",
              "tokenizer_path", "rollout.experiment_name", "rollout.consumer_batch_size", "actor.max_new_tokens"]  # fmt: skip
    for key in silent:
        assert not any(_mentions(m, key) for m in messages), key


_RS = RejectionSamplingConfig(metric="ratio", upper=5.0)
ALGORITHMS = {
    "gsm8k_m2po": ({"actor.m2_threshold": 0.04, "actor.eps_clip": 0.0, "actor.use_decoupled_loss": True,
                    "actor.rejection_sampling": _RS, "actor.recompute_logprob": True},
                   "decoupled loss: AReaL 1.0.4 semantics (rejection_sampling token/ratio mask upper 5.0, M2PO "
                   "m2_threshold 0.04)"),
    "gsm8k_sapo": ({"actor.use_sapo_loss": True, "actor.sapo_tau_pos": 1.0, "actor.sapo_tau_neg": 1.05,
                    "actor.use_decoupled_loss": False, "actor.rejection_sampling": None},
                   "SAPO loss (tau_pos 1.0, tau_neg 1.05): no behaviour weight"),
    "gsm8k_gspo": ({"actor.importance_sampling_level": "sequence", "actor.use_decoupled_loss": True,
                    "actor.rejection_sampling": _RS, "actor.eps_clip": 0.4},
                   "decoupled loss: AReaL 1.0.4 semantics (rejection_sampling token/ratio mask upper 5.0)"),
    "gsm8k_grpo_prox_approx": ({"actor.prox_logp_method": "loglinear", "actor.recompute_logprob": False,
                                "actor.rejection_sampling": _RS},
                               "decoupled loss: AReaL 1.0.4 semantics (rejection_sampling token/ratio mask upper "
                               "5.0, prox_logp_method loglinear)"),
    "gsm8k_grpo_prox_approx_eval": ({"actor.prox_logp_method": "metrics", "actor.recompute_logprob": True,
                                     "actor.rejection_sampling": _RS},
                                    "decoupled loss: AReaL 1.0.4 semantics (rejection_sampling token/ratio mask "
                                    "upper 5.0, prox_logp_method metrics)"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_areal_algorithm_examples_load_with_their_values(name, caplog):
    from laden.rl.settings import ppo_settings

    expected, semantics = ALGORITHMS[name]
    with caplog.at_level(logging.WARNING, logger="laden.config.areal"):
        cfg = load_config(AREAL / f"{name}.yaml", PATHS, job="rl")
    for dotted, value in expected.items():
        assert _value(cfg, dotted) == value, dotted
    assert ppo_settings(cfg).decoupled_semantics() == semantics
    ignored = [m for m in _areal_warnings(caplog) if "rejection_sampling" in m]
    assert len(ignored) == (name == "gsm8k_sapo"), ignored  # AReaL ignores it without the decoupled loss too


def test_loaded_areal_config_round_trips_as_a_laden_config(tmp_path):
    from laden.config import dump_config

    cfg = load_config(AREAL / "gsm8k_grpo.yaml", PATHS, job="rl")
    assert load_config(dump_config(cfg, tmp_path / "config.yaml"), job="rl") == cfg


def test_every_areal_key_has_a_role():
    keys = all_keys()
    leaves = list(areal_leaf_keys())
    assert len(leaves) > 300
    assert [k for k in leaves if key_role(k, keys) is None] == []
    assert key_role("saver.freq_steps", keys) == "mapped"
    assert key_role("rollout.experiment_name", keys) == "copy"
    assert key_role("actor.use_sapo_loss", keys) == "laden"
    assert key_role("actor.enable_tree_training", keys) == "unsupported"
    assert key_role("actor.use_lora", keys) == "laden"
    assert key_role("rollout.use_lora", keys) == "copy"
    assert key_role("stats_logger.wandb.mode", keys) == "laden"
    assert key_role("stats_logger.fileroot", keys) == "copy"
    assert key_role("perf_tracer.enabled", keys) == "ignored"
    assert key_role("actor.eps_clip", keys) == "laden"
    assert key_role("actor.eps_clipp", keys) is None


def _errors(path, overrides, *, job="rl"):
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides, job=job)
    return info.value.errors


def test_unknown_keys_stay_errors_with_a_suggestion():
    errors = _errors(
        AREAL / "gsm8k_grpo.yaml", [*PATHS, "actor.eps_clipp=0.3", "saver.freq_step=5", "zzz.a=1"]
    )
    assert len(errors) == 3, errors
    (laden_section,) = [e for e in errors if e.startswith("actor.eps_clipp=0.3")]
    assert "unknown key; did you mean actor.eps_clip?" in laden_section
    (areal_section,) = [e for e in errors if e.startswith("saver.freq_step=5")]
    assert "neither laden's nor AReaL's; did you mean saver.freq_steps?" in areal_section
    assert any(e.startswith("zzz=") and "unknown key" in e for e in errors)


def test_features_laden_lacks_are_errors_that_say_so():
    errors = _errors(
        AREAL / "gsm8k_grpo.yaml",
        [
            *PATHS,
            "+actor.enable_tree_training=true",
            "actor.rejection_sampling.action=truncate",
        ],
    )
    assert len(errors) == 2, errors
    assert any(
        e.startswith("actor.rejection_sampling.action='truncate': expected one of 'mask'") for e in errors
    )
    assert any(
        e.startswith("actor.enable_tree_training=true: tree training (") and "not implemented" in e
        for e in errors
    )
    (error,) = _errors(AREAL / "gsm8k_grpo.yaml", [*PATHS, "+actor.use_sapo_loss=true"])
    assert error.startswith(
        "actor.use_sapo_loss is not defined with the decoupled loss (AReaL refuses it too)"
    )


def test_copies_must_equal_what_they_copy():
    (error,) = _errors(AREAL / "gsm8k_grpo.yaml", [*PATHS, "rollout.consumer_batch_size=64"])
    assert error.startswith("rollout.consumer_batch_size=64 differs from train_dataset.batch_size=256")
    assert "set rollout.consumer_batch_size: ${train_dataset.batch_size}" in error
    errors = _errors(AREAL / "gsm8k_grpo.yaml", [*PATHS, "tokenizer_path=/elsewhere"])
    assert [e.split(" differs")[0] for e in errors] == [
        "tokenizer_path='/elsewhere'",
        "rollout.tokenizer_path='/elsewhere'",
    ]
    assert all(f"differs from actor.path='{TINY_MODEL}': laden reads actor.path only" in e for e in errors)
    # Overrides land before interpolation, so the copies follow them.
    cfg = load_config(AREAL / "gsm8k_grpo.yaml", [*PATHS, "train_dataset.batch_size=64"], job="rl")
    assert cfg.train_dataset.batch_size == 64


def test_mapped_keys_and_conflicts(tmp_path):
    cfg = load_config(
        AREAL / "gsm8k_grpo.yaml",
        [*PATHS, "saver.freq_steps=50", "recover.mode=auto", "actor.init_from_scratch=true"],
        job="rl",
    )
    assert (cfg.checkpoint.save_freq_steps, cfg.checkpoint.resume, cfg.actor.init_from_config) == (
        50,
        "auto",
        True,
    )
    (error,) = _errors(
        AREAL / "gsm8k_grpo.yaml", [*PATHS, "saver.freq_steps=50", "checkpoint.save_freq_steps=10"]
    )
    assert (
        "saver.freq_steps=50 gives checkpoint.save_freq_steps=50, but checkpoint.save_freq_steps=10" in error
    )
    legacy = AREAL / "gsm8k_grpo_2025_11.yaml"
    (error,) = _errors(legacy, [*PATHS, "rollout.backend=vllm:d4"])
    assert "allocation_mode='sglang.d4p1t1+d4p1t1' gives rollout.backend='sglang:d4p1t1'" in error
    assert (
        load_config(legacy, [*PATHS, "rollout.backend=sglang:d4"], job="rl").rollout.backend
        == "sglang:d4p1t1"
    )
    sync = load_config(legacy, [*PATHS, "async_training=false"], job="rl")
    assert sync.rollout.max_head_offpolicyness == 0


def test_sections_matter_only_where_the_run_uses_them(caplog):
    with caplog.at_level(logging.WARNING, logger="laden.config.areal"):
        load_config(AREAL / "gsm8k_grpo.yaml", [*PATHS, "actor.kl_ctl=0.1"], job="rl")
    (ref,) = [m for m in _areal_warnings(caplog) if _mentions(m, "ref")]
    assert "reference model" in ref and "ref.path" not in ref  # a copy of actor.path: checked, not listed
    (error,) = _errors(AREAL / "gsm8k_grpo.yaml", [*PATHS, "actor.kl_ctl=0.1", "ref.path=/other"])
    assert error.startswith("ref.path='/other' differs from actor.path=")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="laden.config.areal"):
        cfg = load_config(
            AREAL / "gsm8k_grpo.yaml",
            [*PATHS, "rollout.backend=vllm:d4", "vllm.disable_sliding_window=true"],
            job="rl",
        )
    messages = _areal_warnings(caplog)
    assert any(_mentions(m, "vllm.disable_sliding_window") for m in messages)
    assert not any(
        _mentions(m, "sglang") for m in messages
    )  # sglang.skip_tokenizer_init: true, SGLang's alone
    assert (cfg.vllm.max_model_len, cfg.vllm.gpu_memory_utilization) == (32768, 0.8)  # passed: not warned
    assert not any(
        _mentions(m, "vllm.max_model_len") or _mentions(m, "vllm.gpu_memory_utilization") for m in messages
    )


def test_disable_dropout_warns_only_when_the_model_has_dropout(tmp_path, caplog):
    model = tmp_path / "m"
    model.mkdir()
    config = json.loads((TINY_MODEL / "config.json").read_text()) | {"attention_dropout": 0.1}
    (model / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="laden.config.areal"):
        load_config(AREAL / "gsm8k_grpo.yaml", [*PATHS, f"actor.path={model}"], job="rl")
    (message,) = [m for m in _areal_warnings(caplog) if "disable_dropout" in m]
    assert "attention_dropout=0.1" in message and "set those to 0.0" in message


def test_config_from_dict_maps_areal_keys_too():
    data = yaml.safe_load((AREAL / "gsm8k_sft.yaml").read_text())
    data["actor"]["path"] = str(TINY_MODEL)
    data["train_dataset"]["path"] = "train.jsonl"
    data["valid_dataset"]["path"] = "valid.jsonl"
    cfg = config_from_dict(data, job="sft")
    assert cfg.actor.optimizer.lr_scheduler_type == "cosine" and cfg.checkpoint.resume == "never"


# ---------------------------------------------------------------- interpolation


def _yaml(tmp_path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


SFT = [f"actor.path={TINY_MODEL}", "train_dataset.path=data.jsonl"]


def test_interpolation_resolves_after_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("LADEN_TEST_ROOT", str(tmp_path / "runs"))
    path = _yaml(
        tmp_path,
        "experiment_name: exp\ntrial_name: ${experiment_name}-t1\n"
        "cluster: {fileroot: '${oc.env:LADEN_TEST_ROOT}'}\n"
        "gconfig: {n_samples: 4, temperature: 0.7}\n"
        "actor: {group_size: '${gconfig.n_samples}', temperature: '${gconfig.temperature}'}\n",
    )
    cfg = load_config(path, [*SFT, "train_dataset.type=rl", "gconfig.n_samples=6"], job="rl")
    assert (cfg.trial_name, cfg.cluster.fileroot) == ("exp-t1", str(tmp_path / "runs"))
    assert (cfg.actor.group_size, cfg.actor.temperature) == (6, 0.7)
    override = load_config(path, [*SFT, "train_dataset.type=rl", "valid_dataset.path=${train_dataset.path}"])
    assert override.valid_dataset is not None and override.valid_dataset.path == str(
        Path.cwd() / "data.jsonl"
    )


def test_bad_interpolations_name_their_key(tmp_path):
    path = _yaml(
        tmp_path,
        "gconfig: {temperature: 0.7}\n"
        "actor: {temperature: '${gconfig.temprature}', eps_clip: '${actor.eps_clip}', dtype: '${gconfig.x'}\n"
        "seed: '${nope:1}'\n",
    )
    errors = _errors(path, SFT, job="sft")
    assert len(errors) == 4, errors
    assert (
        "actor.temperature='${gconfig.temprature}': cannot resolve the interpolation: gconfig.temprature is not "
        "set; did you mean ${gconfig.temperature}?"
    ) in errors
    assert any(e.startswith("actor.eps_clip='${actor.eps_clip}': cannot resolve") for e in errors)
    assert any(e.startswith("actor.dtype='${gconfig.x': not a valid interpolation") for e in errors)
    assert any(e.startswith("seed='${nope:1}': cannot resolve the interpolation") for e in errors)


# ---------------------------------------------------------------- Hydra-style overrides


def test_plus_adds_a_key_and_tilde_deletes_one(tmp_path):
    path = _yaml(tmp_path, "gconfig: {n_samples: 4}\nvalid_dataset: {path: v.jsonl}\n")
    cfg = load_config(path, [*SFT, "+actor.kl_ctl=0.1", "~valid_dataset", "~gconfig.n_samples=4", "++seed=3"])
    assert (cfg.actor.kl_ctl, cfg.valid_dataset, cfg.gconfig.n_samples, cfg.seed) == (0.1, None, 1, 3)
    errors = _errors(
        path, [*SFT, "+gconfig.n_samples=2", "~gconfig.n_samples=3", "~nope.key", "~"], job="sft"
    )
    assert len(errors) == 4, errors
    assert "override '+gconfig.n_samples=2': gconfig.n_samples is already set (to 4)" in errors[0]
    assert "write gconfig.n_samples=2 to change it" in errors[0]
    assert "override '~gconfig.n_samples=3': gconfig.n_samples is 4, not 3" in errors[1]
    assert "override '~nope.key': nope.key is not set, so there is nothing to delete" in errors[2]
    assert "override '~':" in errors[3] and "'~dotted.key' (delete one)" in errors[3]


def test_tilde_deletes_an_areal_setting():
    cfg = load_config(AREAL / "gsm8k_grpo.yaml", [*PATHS, "~actor.rejection_sampling"], job="rl")
    assert cfg.actor.behav_imp_weight_cap is None


# ---------------------------------------------------------------- allocation modes AReaL accepts


@pytest.mark.parametrize("text", ["sglang:d4p1t1", "vllm:d2p1t2", "sglang:d4"])
def test_rollout_pipeline_size_one_is_valid(text):
    assert check_alloc(text, role="rollout", field="rollout.backend") == []


def test_rollout_pipeline_parallel_is_not_supported():
    assert (
        check_alloc("sglang:d2p2", role="rollout", field="rollout.backend", require_implemented=False) == []
    )
    (error,) = check_alloc("sglang:d2p2", role="rollout", field="rollout.backend")
    assert "pipeline parallel generation (p2) is not supported" in error and "sglang:d2t2" in error


def test_expert_parallel_counted_as_areal_counts_it():
    # AReaL: e divides the d*t*c GPUs of a pipeline stage, not d alone.
    assert check_alloc("megatron:d2p2t4e4", role="actor", field="f", require_implemented=False) == []
    assert AllocationMode.parse("megatron:d2p2t4e4").num_gpus == 16
    (error,) = check_alloc("megatron:d2t2e3", role="actor", field="f", require_implemented=False)
    assert "e=3 must divide data parallel size d=2 times tensor and context sizes t*c=2 (d*t*c=4)" in error


@pytest.mark.parametrize(
    "text",
    [
        "megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)",
        "archon:attn:d4p2t2c2|ffn:t4e2",
        "megatron:(attn:d1p12t4|ffn:d1p12e4)",
    ],
)
def test_moe_hybrid_form_parses_round_trips_and_its_tensor_parallel_experts_are_refused(text):
    mode = AllocationMode.parse(text)
    assert mode.format() == text and AllocationMode.parse(mode.format()) == mode
    assert check_alloc(mode, role="actor", field="actor.backend", require_implemented=False) == []
    (error,) = check_alloc(mode, role="actor", field="actor.backend")
    assert "implements data, pipeline, tensor, context and expert parallel, not " in error


def test_moe_hybrid_rules():
    hybrid = AllocationMode.parse("megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)")
    assert (hybrid.dp, hybrid.tp, hybrid.cp, hybrid.pp, hybrid.ep, hybrid.num_gpus) == (4, 2, 2, 2, 2, 32)
    cases = {
        "megatron:(attn:d2p2t1c4|ffn:d2p4t1e2)": "pipeline parallel sizes differ",
        "megatron:(attn:d4p2t1c1|ffn:d2p2t2e2)": "cover different numbers of GPUs",
        "megatron:(attn:d4p2|ffn:t3)": "does not divide",
        "fsdp:(attn:d2|ffn:e2)": "is for the training backends megatron, archon",
    }
    for text, reason in cases.items():
        (error,) = check_alloc(text, role="actor", field="f", require_implemented=False)
        assert reason in error, text
    for text, reason in [("megatron:(attn:d2e2|ffn:e2)", "'e' is not allowed in the attn part"),
                         ("megatron:(attn:d2|ffn:e2", "unbalanced parentheses")]:  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(reason)):
            AllocationMode.parse(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("sglang:d4p1t1+fsdp:d4p1t1", ("sglang:d4p1t1", "fsdp:d4p1t1", False)),
        ("sglang.d4p1t1+d4p1t1", ("sglang:d4p1t1", "fsdp:d4p1t1", True)),
        ("vllm[rollout]:d2+megatron[actor]:d2p2", ("vllm:d2", "megatron:d2p2", False)),
        ("sglang:d2+d2p2", ("sglang:d2", "megatron:d2p2", True)),
        (
            "sglang:d4+megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)",
            ("sglang:d4", "megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)", False),
        ),
        ("fsdp:d8", (None, "fsdp:d8", False)),
    ],
)
def test_areal_allocation_mode_strings(text, expected):
    assert split_areal_allocation(text) == expected


def test_colocated_allocation_mode_is_refused_with_the_fix():
    (error,) = _errors(AREAL / "gsm8k_grpo.yaml", [*PATHS, "+allocation_mode=sglang:d4|fsdp:d4"])
    assert error.startswith("allocation_mode='sglang:d4|fsdp:d4': 'sglang:d4|fsdp:d4' colocates engines")
    assert "rollout.backend: native:d<N>" in error
