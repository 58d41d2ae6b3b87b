"""Configuration tree: loading, overrides, error collection, cross-field rules, docs."""

from __future__ import annotations

import dataclasses
import json
import typing
import warnings
from pathlib import Path

import pytest
import yaml
from repo_paths import ROOT

from laden.config import (
    ConfigError,
    DatasetConfig,
    LadenConfig,
    config_reference_markdown,
    config_to_dict,
    dump_config,
    field_docs,
    format_config,
    load_config,
    missing_docstrings,
    run_dir,
    validate_against_model,
)
from laden.config.docs import sections

TINY_MODEL = ROOT / "laden" / "assets" / "tiny"  # config.json: 4 heads, 2 kv
SFT = [f"actor.path={TINY_MODEL}", "train_dataset.path=data.jsonl"]
RL = [*SFT, "train_dataset.type=rl"]


def _errors(overrides, *, job="sft", path=None):
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides, job=job)
    assert isinstance(info.value, ValueError)
    for line in info.value.errors:
        assert line in str(info.value)
    return info.value.errors


def test_defaults_and_run_dir():
    cfg = load_config(None, SFT, job="sft")
    assert cfg.actor.backend == "fsdp:d1"
    assert cfg.actor.mb_spec.max_tokens_per_mb is None
    assert cfg.valid_dataset is None
    assert cfg.gconfig.stop_token_ids == []
    assert run_dir(cfg) == Path.cwd() / "runs/laden/run0"  # the default fileroot, under the working directory
    assert cfg.run_dir == run_dir(cfg)


def test_every_section_is_kw_only_with_slots():
    for _, cls in sections():
        assert "__slots__" in vars(cls), cls
        with pytest.raises(TypeError):
            cls(*[f.default for f in dataclasses.fields(cls)][:1])


def test_yaml_then_overrides_precedence(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "actor": {"path": str(TINY_MODEL), "mb_spec": {"max_tokens_per_mb": 2048, "n_mbs": 3}},
                "train_dataset": {"path": "d.jsonl", "max_length": 512},
                "rollout": {"backend": "native:d1"},
            }
        )
    )
    cfg = load_config(
        path,
        [
            "actor.mb_spec.max_tokens_per_mb=4096",
            "actor.optimizer.type=sgd",
            'rollout.backend="sglang:d2t2"',
            "valid_dataset.path=x.jsonl",
        ],
        job="sft",
    )
    assert cfg.actor.mb_spec.max_tokens_per_mb == 4096  # override wins
    assert cfg.actor.mb_spec.n_mbs == 3  # untouched YAML value kept
    assert cfg.train_dataset.max_length == 512
    assert cfg.actor.optimizer.type == "sgd"
    assert cfg.rollout.backend == "sglang:d2t2"
    assert cfg.valid_dataset == DatasetConfig(
        path=str(Path.cwd() / "x.jsonl")
    )  # an override: against the cwd
    assert cfg.train_dataset.path == str(tmp_path / "d.jsonl")  # written in the file: against its directory


def test_mapping_override_merges_into_section(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("actor:\n  mb_spec:\n    n_mbs: 3\n")
    cfg = load_config(path, [*SFT, "actor.mb_spec={max_tokens_per_mb: 4096}"], job="sft")
    assert (cfg.actor.mb_spec.n_mbs, cfg.actor.mb_spec.max_tokens_per_mb) == (3, 4096)


def test_all_mistakes_reported_at_once():
    errors = _errors(
        [
            "actor.mb_spec.max_token_per_mb=4096",  # unknown key
            "actor.optimizer.type=adm",  # bad choice
            "train_dataset.batch_size=abc",  # wrong type
            "sglang.mem_fraction_static=1.5",  # out of range
            "actor.backend=fsdp:d2p2",  # p on fsdp
            "no_equals_sign",  # bad override syntax
            "train_dataset.max_length=2048",
            "actor.mb_spec.max_tokens_per_mb=1024",  # smaller than max_length
        ],
        job="any",
    )
    assert len(errors) == 7
    keys = ["max_token_per_mb", "actor.optimizer.type", "batch_size", "mem_fraction_static", "fsdp:d2p2"]
    for key in [*keys, "no_equals_sign", "max_tokens_per_mb=1024"]:
        assert sum(key in e for e in errors) >= 1, key


def test_unknown_key_suggests_closest():
    (error,) = _errors([*SFT, "actor.mb_spec.max_token_per_mb=4096"])
    assert error.startswith("actor.mb_spec.max_token_per_mb=4096: unknown key")
    assert "did you mean actor.mb_spec.max_tokens_per_mb?" in error
    (error,) = _errors([*SFT, "lr=0.1"])
    assert "did you mean actor.optimizer.lr or critic.optimizer.lr?" in error
    (error,) = _errors([*SFT, "zzzz=1"])
    assert "remove it" in error


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("gconfig.max_new_tokens=abc", "gconfig.max_new_tokens='abc': expected an integer"),
        ("gconfig.max_new_tokens=12.5", "expected an integer"),
        ("gconfig.max_new_tokens=true", "expected an integer"),
        ("gconfig.max_new_tokens=null", "gconfig.max_new_tokens=null: expected an integer"),
        ("train_dataset.shuffle=1", "train_dataset.shuffle=1: expected true or false"),
        ("gconfig.top_p=abc", "expected a number"),
        ("actor.mb_spec.max_tokens_per_mb=big", "expected an integer"),
        ("actor.dtype=fp16", "expected one of 'bfloat16', 'float16', 'float32'"),
        ("gconfig.stop_token_ids=[1, x]", "expected a list of integers"),
        ("actor.mb_spec=4096", "actor.mb_spec=4096: this is a section"),
        ("valid_dataset=3", "valid_dataset=3: this is a section"),
    ],
)
def test_wrong_types(override, expected):
    (error,) = _errors([*SFT, override])
    assert expected in error


def test_accepted_conversions():
    cfg = load_config(
        None,
        [
            *SFT,
            "actor.optimizer.lr=1",  # int for a float
            "actor.optimizer.eps=1e-6",  # YAML 1.1 string for a float
            "actor.mb_spec.max_tokens_per_mb=null",  # Optional
            "trial_name=7",  # int for a string
            "valid_dataset=null",
        ],
        job="sft",
    )
    assert cfg.actor.optimizer.lr == 1.0 and isinstance(cfg.actor.optimizer.lr, float)
    assert cfg.actor.optimizer.eps == 1e-6
    assert cfg.actor.mb_spec.max_tokens_per_mb is None
    assert cfg.trial_name == "7"
    assert cfg.valid_dataset is None


@pytest.mark.parametrize("override", ["no_equals", "=3", "actor..path=x", ".x=1"])
def test_bad_override_syntax(override):
    (error,) = _errors([*SFT, override])
    assert repr(override) in error and "dotted.key=value" in error


def test_max_tokens_per_mb_rule_sft():
    (error,) = _errors([*SFT, "actor.mb_spec.max_tokens_per_mb=1000"], job="sft")
    assert error == (
        "actor.mb_spec.max_tokens_per_mb=1000 is smaller than train_dataset.max_length = 1024; "
        "set it to at least 1024"
    )
    load_config(None, [*SFT, "actor.mb_spec.max_tokens_per_mb=1024"], job="sft")


def test_max_tokens_per_mb_rule_rl():
    overrides = [
        *RL,
        "train_dataset.max_length=1024",
        "gconfig.max_new_tokens=3072",
        "actor.mb_spec.max_tokens_per_mb=2048",
    ]
    (error,) = _errors(overrides, job="rl")
    assert error == (
        "actor.mb_spec.max_tokens_per_mb=2048 is smaller than train_dataset.max_length + "
        "gconfig.max_new_tokens = 4096; set it to at least 4096"
    )
    cfg = load_config(None, [*overrides, "actor.mb_spec.max_tokens_per_mb=4096"], job="rl")
    assert cfg.actor.mb_spec.max_tokens_per_mb == 4096


def test_adam_with_bf16_storage_warns():
    with pytest.warns(UserWarning, match="adam_bf16"):
        load_config(None, [*SFT, "actor.optimizer_dtype=bfloat16"], job="sft")


def test_adam_bf16_with_bf16_storage_is_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(
            None, [*SFT, "actor.optimizer_dtype=bfloat16", "actor.optimizer.type=adam_bf16"], job="sft"
        )


def test_adam_bf16_with_fp32_storage_warns_ignored():
    with pytest.warns(UserWarning, match="ignored"):
        load_config(None, [*SFT, "actor.optimizer.type=adam_bf16"], job="sft")


def test_ignored_backend_section_warns():
    with pytest.warns(UserWarning, match=r"actor\.fsdp\.\{offload_params\} are ignored"):
        load_config(None, [*SFT, "actor.backend=roundpipe:d1", "actor.fsdp.offload_params=true"], job="sft")


def test_top_level_max_concurrent_rollouts_alias():
    cfg = load_config(None, [*RL, "max_concurrent_rollouts=200"], job="rl")
    assert cfg.rollout.max_concurrent_rollouts == 200
    same = load_config(None, [*RL, "max_concurrent_rollouts=200", "rollout.max_concurrent_rollouts=200"])
    assert same.rollout.max_concurrent_rollouts == 200
    (error,) = _errors([*RL, "max_concurrent_rollouts=200", "rollout.max_concurrent_rollouts=256"], job="rl")
    assert "max_concurrent_rollouts=200 conflicts with rollout.max_concurrent_rollouts=256" in error


def test_archon_loads_and_its_section_warns_under_another_engine():
    cfg = load_config(None, [*SFT, "actor.backend=archon:d2p2e2", "cluster.n_gpus_per_node=4",
                             "actor.archon.pp_schedule=GPipe"])  # fmt: skip
    assert cfg.actor.archon.pp_schedule == "GPipe"
    (error,) = _errors([*SFT, "actor.archon.pp_schedule=ZBVZeroBubble"])
    assert "actor.archon.pp_schedule" in error and "Interleaved1F1B" in error
    with pytest.warns(UserWarning, match=r"actor.archon.\{pp_schedule\} are ignored"):
        load_config(None, [*SFT, "actor.archon.pp_schedule=GPipe"])


def test_gpu_totals():
    (error,) = _errors([*SFT, "actor.backend=fsdp:d4", "cluster.n_gpus_per_node=2"])
    assert "needs 4 GPUs but cluster.n_nodes * cluster.n_gpus_per_node = 1 * 2 = 2" in error
    load_config(None, [*SFT, "actor.backend=fsdp:d4", "cluster.n_nodes=2", "cluster.n_gpus_per_node=2"])
    server = [*RL, "actor.backend=fsdp:d2", "rollout.backend=sglang:d2"]
    (error,) = _errors([*server, "cluster.n_gpus_per_node=2"], job="rl")
    assert "needs 2 GPUs of its own" in error and "4 GPUs" in error
    load_config(None, [*server, "cluster.n_gpus_per_node=4"], job="rl")
    # The embedded engine shares the training GPUs.
    load_config(
        None, [*RL, "actor.backend=fsdp:d2", "rollout.backend=native:d2", "cluster.n_gpus_per_node=2"]
    )


def test_rollout_backend_checked_only_for_rl():
    load_config(None, [*SFT, "rollout.backend=sglang:d2c2"], job="sft")
    (error,) = _errors([*RL, "rollout.backend=sglang:d2c2", "cluster.n_gpus_per_node=8"], job="rl")
    assert error.startswith("rollout.backend='sglang:d2c2'")


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("sglang.mem_fraction_static=0", "sglang.mem_fraction_static=0.0 must be in (0, 1]"),
        ("native.mem_fraction_static=1.01", "native.mem_fraction_static=1.01 must be in (0, 1]"),
        ("gconfig.top_p=0", "gconfig.top_p=0.0 must be in (0, 1]"),
        ("actor.optimizer.warmup_steps_proportion=1", "must be in [0, 1)"),
        ("actor.optimizer.lr=0", "actor.optimizer.lr=0.0 must be greater than 0"),
        ("actor.optimizer.lr=.nan", "actor.optimizer.lr=nan must be greater than 0"),
        ("train_dataset.batch_size=0", "train_dataset.batch_size=0 must be at least 1"),
        ("actor.mb_spec.n_mbs=-1", "actor.mb_spec.n_mbs=-1 must be at least 1"),
        ("cluster.n_gpus_per_node=-1", "cluster.n_gpus_per_node=-1 must be at least 0"),  # 0: the CPU
        ("gconfig.temperature=0", "set gconfig.greedy: true"),
        ("gconfig.min_new_tokens=300", "larger than gconfig.max_new_tokens=256"),
        ("trial_name=a/b", "contains '/'"),
    ],
)
def test_range_rules(override, expected):
    (error,) = _errors([*SFT, override])
    assert expected in error


def test_job_requires_paths_and_matching_type():
    errors = _errors([], job="sft")
    assert len(errors) == 2
    assert any(e.startswith("train_dataset.path=''") for e in errors)
    assert any(e.startswith("actor.path=''") for e in errors)
    (error,) = _errors(SFT, job="rl")
    assert "train_dataset.type='sft' does not match the 'rl' job" in error
    load_config(None, [], job="any")  # `laden config show` on defaults


def test_missing_or_bad_file(tmp_path):
    (error,) = _errors([], job="any", path=tmp_path / "nope.yaml")
    assert "does not exist" in error
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    (error,) = _errors([], job="any", path=bad)
    assert "expected a mapping" in error


def _model_dir(path: Path, **config) -> Path:
    """A model directory holding only a config.json (what validation reads)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_validate_against_model_head_rule(tmp_path):
    model = _model_dir(tmp_path / "m40", num_attention_heads=40, num_key_value_heads=8)
    cfg = load_config(
        None, [*SFT, f"actor.path={model}", "actor.backend=fsdp:d1t2c4", "cluster.n_gpus_per_node=8"]
    )
    assert validate_against_model(cfg, num_attention_heads=40, num_key_value_heads=8) == []
    cfg.actor.backend = "fsdp:c16"
    (error,) = validate_against_model(cfg, num_attention_heads=40, num_key_value_heads=8)
    assert error.startswith("actor.backend='fsdp:c16': context (c) size 16 must divide")
    cfg.actor.backend = "fsdp:t4c4"  # 4 and 4 each fine, but heads split 16 ways
    (error,) = validate_against_model(cfg, num_attention_heads=40, num_key_value_heads=8)
    assert "t*c size 16" in error
    cfg.actor.backend = "fsdp:d1"
    cfg.rollout.backend = "sglang:t32"
    (error,) = validate_against_model(cfg, num_attention_heads=40, num_key_value_heads=8)
    assert error.startswith("rollout.backend='sglang:t32': tensor (t) size 32")


def test_dump_load_round_trip(tmp_path):
    cfg = load_config(
        None,
        [
            *RL,
            "experiment_name=exp",
            "actor.optimizer.lr=3e-6",
            "actor.optimizer.type=adam_bf16",
            "actor.optimizer_dtype=bfloat16",
            "actor.backend=roundpipe:d1",
            "actor.roundpipe.model_memory_limit=8",
            "gconfig.stop_token_ids=[3, 7]",
            "gconfig.max_new_tokens=64",
            "valid_dataset.path=v.parquet",
            "max_concurrent_rollouts=32",
            "rollout.backend=sglang:d1",
            "cluster.n_gpus_per_node=2",
        ],
        job="rl",
    )
    path = dump_config(cfg, tmp_path / "out" / "config.yaml")
    again = load_config(path, job="rl")
    assert again == cfg
    assert config_to_dict(again) == config_to_dict(cfg)
    assert yaml.safe_load(format_config(cfg)) == config_to_dict(cfg)


def _all_dotted_fields():
    out = []
    for name, cls in sections():
        out += [f"{name}.{f.name}" if name else f.name for f in dataclasses.fields(cls)]
    return out


def test_every_field_has_a_docstring():
    assert missing_docstrings() == []
    for _, cls in sections():
        docs = field_docs(cls)
        assert set(docs) == {f.name for f in dataclasses.fields(cls)}, cls
        assert all(docs.values()), cls


def test_docs_contain_every_field():
    text = config_reference_markdown()
    fields = _all_dotted_fields()
    assert len(fields) > 80
    for dotted in fields:
        assert f"| `{dotted}` |" in text, dotted
    assert "Literal['ffd', 'kk']" in text
    assert "| `actor.mb_spec.n_mbs` | `int` | `1` |" in text


def test_every_top_level_section_documented_and_typed():
    hints = typing.get_type_hints(LadenConfig)
    names = {name.removesuffix("[]") for name, _ in sections() if name and "." not in name}
    assert names == {
        k
        for k, tp in hints.items()
        if dataclasses.is_dataclass(_strip_optional(tp))
        or dataclasses.is_dataclass(typing.get_args(tp)[0] if typing.get_origin(tp) is list else None)
    }


def _strip_optional(tp):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if len(args) == 1 else tp


def test_fields_a_job_does_not_read_are_named_with_where_they_act():
    from laden.config.usage import fields_without_effect

    cfg = load_config(
        "examples/sft_tiny.yaml",
        ["rollout.max_concurrent_rollouts=64", "actor.weight_update_mode=disk", "actor.roundpipe.num_microbatch=8",
         "actor.fsdp.offload_params=true"],
    )  # fmt: skip
    fsdp = fields_without_effect(cfg, job="sft", engine="fsdp")
    assert any(
        line.startswith("rollout.max_concurrent_rollouts=64 has no effect in `laden sft`") for line in fsdp
    )
    assert any(line.startswith("actor.weight_update_mode='disk'") and "`laden rl`" in line for line in fsdp)
    assert any(line.startswith("actor.roundpipe.num_microbatch=8") and "roundpipe:" in line for line in fsdp)
    assert not any(line.startswith("actor.fsdp.") for line in fsdp)  # read by this engine
    roundpipe = fields_without_effect(cfg, job="sft", engine="roundpipe")
    assert any(line.startswith("actor.fsdp.offload_params=True") for line in roundpipe)
    assert fields_without_effect(load_config("examples/sft_tiny.yaml", []), job="sft", engine="fsdp") == []


def test_evaluator_generate_is_named_as_without_effect_in_laden_rl():
    from laden.config.usage import fields_without_effect

    cfg = load_config("examples/rl_tiny.yaml", ["evaluator.generate=true"])
    assert any(line.startswith("evaluator.generate=True has no effect in `laden rl`")
               for line in fields_without_effect(cfg, job="rl", engine="fsdp"))  # fmt: skip
    sft = load_config("examples/sft_tiny.yaml", ["evaluator.generate=true"])
    assert not any(
        line.startswith("evaluator.") for line in fields_without_effect(sft, job="sft", engine="fsdp")
    )
