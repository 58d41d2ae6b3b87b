"""The `vllm` / `sglang` server settings: AReaL's keys that now reach the servers, and their validation."""

from __future__ import annotations

import logging
import warnings

import pytest
import yaml
from areal_copies import AREAL, PATHS
from rl_runs import tiny_rl_config

from laden.config import ConfigError, config_from_dict, load_config
from laden.config.usage import fields_without_effect


def _areal_file(tmp_path, section: str, extra: dict) -> str:
    """AReaL's GSM8K GRPO example with more keys in its `section`."""
    data = yaml.safe_load((AREAL / "gsm8k_grpo.yaml").read_text())
    data[section].update(extra)
    path = tmp_path / "areal.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _load_areal(path: str, backend: str, caplog) -> tuple[object, list[str]]:
    with caplog.at_level(logging.WARNING, logger="laden.config.areal"):
        cfg = load_config(path, [*PATHS, f"rollout.backend={backend}:d4"], job="rl")
    return cfg, [r.getMessage() for r in caplog.records if r.name == "laden.config.areal"]


def test_areal_vllm_keys_laden_passes_are_kept_and_the_others_still_reported(tmp_path, caplog):
    path = _areal_file(
        tmp_path,
        "vllm",
        {"max_num_seqs": 64, "enforce_eager": True, "swap_space": 4, "no_enable_prefix_caching": True},
    )
    cfg, messages = _load_areal(path, "vllm", caplog)
    assert (cfg.vllm.max_num_seqs, cfg.vllm.enforce_eager, cfg.vllm.max_model_len) == (64, True, 32768)
    (swap,) = [m for m in messages if "vllm.swap_space=4" in m]
    assert "no swap_space" in swap and "max_num_seqs" in swap  # names what is passed, and why this is not
    (prefix,) = [m for m in messages if "vllm.no_enable_prefix_caching=true" in m]
    assert "vllm.enable_prefix_caching: false" in prefix
    assert not any("vllm.max_num_seqs=" in m or "vllm.enforce_eager=" in m for m in messages)


def test_areal_sglang_keys_laden_passes_are_kept_and_the_others_still_reported(tmp_path, caplog):
    path = _areal_file(tmp_path, "sglang", {"max_running_requests": 64, "attention_backend": "fa3",
                                            "disable_radix_cache": True, "schedule_policy": "fcfs"})  # fmt: skip
    cfg, messages = _load_areal(path, "sglang", caplog)
    got = (cfg.sglang.max_running_requests, cfg.sglang.attention_backend, cfg.sglang.disable_radix_cache,
           cfg.sglang.context_length)  # fmt: skip
    assert got == (64, "fa3", True, 32768)
    (policy,) = [m for m in messages if "sglang.schedule_policy='fcfs'" in m]
    assert "SGLang's other options are not passed" in policy
    assert not any(
        f"sglang.{key}=" in m for m in messages for key in ("max_running_requests", "attention_backend")
    )


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("vllm.gpu_memory_utilization=1.5", "vllm.gpu_memory_utilization=1.5 must be in (0, 1]; set it to a fraction"),
        ("vllm.gpu_memory_utilization=0", "vllm.gpu_memory_utilization=0.0 must be in (0, 1]"),
        ("vllm.max_num_seqs=0", "vllm.max_num_seqs=0 must be at least 1; set it to a positive integer"),
        ("vllm.max_model_len=-1", "vllm.max_model_len=-1 must be at least 1"),
        ("vllm.block_size=0", "vllm.block_size=0 must be at least 1"),
        ("vllm.cpu_offload_gb=-2", "vllm.cpu_offload_gb=-2.0 must be a finite number >= 0"),
        ("sglang.context_length=0", "sglang.context_length=0 must be at least 1"),
        ("sglang.max_running_requests=0", "sglang.max_running_requests=0 must be at least 1"),
        ("sglang.max_prefill_tokens=0", "sglang.max_prefill_tokens=0 must be at least 1"),
        ("sglang.chunked_prefill_size=0", "sglang.chunked_prefill_size=0 must be -1 (no chunking) or at least 1; "
                                          "set it to e.g. 8192"),
        ("sglang.attention_backend=' '", "sglang.attention_backend=' ' names no backend; set it to e.g. fa3"),
    ],
)  # fmt: skip
def test_bad_server_settings_are_refused_with_field_value_and_fix(tmp_path, override, expected):
    with pytest.raises(ConfigError) as info:
        tiny_rl_config(tmp_path, override)
    assert any(e.startswith(expected) for e in info.value.errors), info.value.errors


def test_good_server_settings_load(tmp_path):
    cfg = tiny_rl_config(tmp_path, "vllm.gpu_memory_utilization=1.0", "vllm.cpu_offload_gb=0",
                         "sglang.chunked_prefill_size=-1")  # fmt: skip
    assert (cfg.vllm.gpu_memory_utilization, cfg.vllm.cpu_offload_gb, cfg.sglang.chunked_prefill_size) == (
        1.0,
        0,
        -1,
    )


def test_server_settings_in_an_sft_run_are_named_as_without_effect():
    cfg = config_from_dict({"vllm": {"max_num_seqs": 64}, "sglang": {"max_running_requests": 8}})
    lines = fields_without_effect(cfg, job="sft", engine="fsdp")
    assert "vllm.max_num_seqs=64 has no effect in `laden sft` on the fsdp engine; it takes effect in `laden rl` " \
           "with rollout.backend=vllm" in lines  # fmt: skip
    assert any(line.startswith("sglang.max_running_requests=8 has no effect") for line in lines)


def test_server_settings_of_another_rollout_backend_are_named_as_without_effect(tmp_path):
    cfg = tiny_rl_config(
        tmp_path, "vllm.max_num_seqs=64", "sglang.context_length=512"
    )  # rollout.backend: native
    lines = fields_without_effect(cfg, job="rl", engine="fsdp")
    assert [line.split(" has no effect")[0] for line in lines] == [
        "vllm.max_num_seqs=64",
        "sglang.context_length=512",
    ]
    assert lines[0].endswith("it takes effect in `laden rl` with rollout.backend=vllm:...")
    served = tiny_rl_config(
        tmp_path, "cluster.n_gpus_per_node=2", "rollout.backend=vllm:d1", "vllm.max_num_seqs=64"
    )
    assert fields_without_effect(served, job="rl", engine="fsdp") == []


@pytest.mark.parametrize(
    ("backend", "field"), [("vllm", "vllm.max_model_len"), ("sglang", "sglang.context_length")]
)
def test_a_server_context_below_the_longest_request_is_warned(tmp_path, backend, field):
    base = [f"rollout.backend={backend}:d1", "cluster.n_gpus_per_node=2", "train_dataset.max_length=100",
            "gconfig.max_new_tokens=28"]  # fmt: skip
    with pytest.warns(UserWarning, match=rf"{field}=127 is below .* = 100 \+ 28 = 128: .* set {field}: 128"):
        tiny_rl_config(tmp_path, *base, f"{field}=127")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_rl_config(tmp_path, *base, f"{field}=128")
    assert not [w for w in caught if "is below train_dataset.max_length" in str(w.message)]
