"""Allocation-mode grammar, backend capabilities and the attention-head rule."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from laden.config.alloc import (
    BACKEND_DIMS,
    DIM_LETTERS,
    IMPLEMENTED_BACKENDS,
    AllocationMode,
    archon_layout,
    check_alloc,
    head_rule_errors,
    valid_head_sizes,
)

SEED_MODES = [
    "sglang:d2t2",
    "sglang:d4",
    "fsdp:d4",
    "fsdp:d2c2",
    "fsdp:d2t2",
    "archon:d2p2e2",
    "roundpipe:d2",
    "native:d2t1",
]


@pytest.mark.parametrize("text", SEED_MODES)
def test_seed_modes_round_trip(text):
    mode = AllocationMode.parse(text)
    assert str(mode) == text
    assert mode.format() == text
    assert AllocationMode.parse(mode.format()) == mode


@pytest.mark.parametrize(
    ("text", "sizes", "num_gpus"),
    [
        ("sglang:d2t2", dict(dp=2, tp=2), 4),
        ("fsdp:d2c2", dict(dp=2, cp=2), 4),
        ("archon:d2p2e2", dict(dp=2, pp=2, ep=2), 4),  # e overlays d: still 4 GPUs
        ("native:d2t1", dict(dp=2), 2),
        ("roundpipe:d2", dict(dp=2), 2),
    ],
)
def test_parsed_sizes_and_gpu_count(text, sizes, num_gpus):
    mode = AllocationMode.parse(text)
    expected = dict(dp=1, tp=1, cp=1, pp=1, ep=1) | sizes
    assert {k: getattr(mode, k) for k in expected} == expected
    assert mode.num_gpus == num_gpus


def test_order_kept_for_format_but_not_for_equality():
    a, b = AllocationMode.parse("sglang:t2d2"), AllocationMode.parse("sglang:d2t2")
    assert a == b
    assert str(a) == "sglang:t2d2"


def test_format_without_written_order_uses_canonical_order():
    assert AllocationMode(backend="fsdp", cp=2, dp=2).format() == "fsdp:d2c2"
    assert AllocationMode(backend="native").format() == "native:d1"


@given(
    backend=st.sampled_from(["fsdp", "sglang", "archon", "my_engine2"]),
    letters=st.permutations(DIM_LETTERS).flatmap(lambda p: st.sampled_from([p[:k] for k in range(1, 6)])),
    sizes=st.lists(st.integers(1, 64), min_size=5, max_size=5),
)
def test_round_trip_property(backend, letters, sizes):
    text = backend + ":" + "".join(f"{k}{n}" for k, n in zip(letters, sizes))
    mode = AllocationMode.parse(text)
    assert str(mode) == text
    assert mode.num_gpus == mode.dp * mode.tp * mode.cp * mode.pp


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("d2t2", "backend is missing"),
        (":d2", "backend is missing"),
        ("fsdp:", "no dimensions"),
        ("fsdp:x2", "unknown dimension letter 'x'"),
        ("fsdp:d2d2", "'d' is repeated"),
        ("fsdp:d0", "size 0"),
        ("fsdp:d02", "leading zero"),
        ("fsdp:d", "cannot read 'd'"),
        ("fsdp:2", "cannot read '2'"),
        ("fsdp:d2t", "cannot read 't'"),
        ("fsdp:d2 t2", "cannot read ' t2'"),
        ("FSDP:d2", "lower-case"),
    ],
)
def test_grammar_errors_name_string_reason_and_syntax(text, reason):
    with pytest.raises(ValueError) as info:
        AllocationMode.parse(text)
    message = str(info.value)
    assert repr(text) in message
    assert reason in message
    assert "e.g. 'fsdp:d2t2'" in message


@pytest.mark.parametrize(
    "text", ["sglang:d2t2", "sglang:d4", "vllm:d1t2", "native:d1", "native:d1t2", "native:d2t2"]
)
def test_seed_rollout_modes_are_valid_and_implemented(text):
    assert check_alloc(text, role="rollout", field="rollout.backend") == []


@pytest.mark.parametrize(
    ("text", "role"),
    [
        ("fsdp:d4", "actor"),
        ("fsdp:d2c2", "actor"),
        ("fsdp:d2t2", "actor"),
        ("roundpipe:d2", "actor"),
    ],
)
def test_implemented_seed_modes_are_valid(text, role):
    assert check_alloc(text, role=role, field=f"{role}.backend") == []


@pytest.mark.parametrize(
    "text", ["archon:d2p2e2", "archon:d1p2", "megatron:d2p2e2", "megatron:(attn:d4p2|ffn:e2)"]
)
def test_archon_and_megatron_modes_run(text):
    assert check_alloc(text, role="actor", field="actor.backend") == []


def test_archon_runs_tensor_and_context_parallel_beside_experts_but_not_experts_split_over_tensor_ranks():
    for text in (
        "archon:d1p2t2",
        "archon:d2p2c2",
        "archon:d2p2c2e2",
        "archon:d2t2e2",
        "megatron:(attn:d4p2t2|ffn:e2)",
    ):
        assert check_alloc(text, role="actor", field="actor.backend") == [], text
    (error,) = check_alloc("megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)", role="actor", field="actor.backend")
    assert "not tensor-parallel experts (ffn:...t4) yet" in error and "(megatron:d16p2e2)" in error
    assert archon_layout(AllocationMode.parse("megatron:(attn:d4p2|ffn:e2)")) == (4, 2, 2)


def test_pipeline_on_fsdp_names_the_backends_that_support_it():
    (error,) = check_alloc("fsdp:d2p2", role="actor", field="actor.backend")
    assert error.startswith("actor.backend='fsdp:d2p2': backend 'fsdp' does not support pipeline")
    assert "archon, megatron" in error


def test_unsupported_dims_each_reported():
    errors = check_alloc("roundpipe:d2t2c2", role="actor", field="actor.backend")
    assert len(errors) == 2
    assert "tensor" in errors[0] and "fsdp, archon, megatron" in errors[0]
    assert "context" in errors[1]
    (error,) = check_alloc("sglang:d2c2", role="rollout", field="rollout.backend")
    assert "no backend supports it" in error


def test_size_one_dims_are_harmless():
    assert check_alloc("fsdp:d4p1", role="actor", field="actor.backend") == []


def test_expert_must_divide_data():
    (error,) = check_alloc("archon:d4e3", role="actor", field="actor.backend", require_implemented=False)
    assert "e=3 must divide data parallel size d=4" in error
    assert "{1, 2, 4}" in error


def test_backend_in_the_wrong_role():
    (error,) = check_alloc("sglang:d2", role="actor", field="actor.backend")
    assert "unknown actor backend 'sglang'" in error
    assert "rollout.backend" in error
    (error,) = check_alloc("nope:d2", role="rollout", field="rollout.backend")
    assert "native, sglang, vllm" in error


def test_parse_error_is_prefixed_with_field():
    (error,) = check_alloc("fsdp:d2d2", role="actor", field="actor.backend")
    assert error.startswith("actor.backend='fsdp:d2d2': invalid allocation mode")


def test_implemented_backends_are_known_backends():
    for role, names in IMPLEMENTED_BACKENDS.items():
        assert set(names) <= set(BACKEND_DIMS[role])


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_head_rule_seed_example_valid(size):
    assert head_rule_errors(size, 40, 8, field="actor.backend", axis_name="context") == []


@pytest.mark.parametrize("size", [16, 32])
def test_head_rule_seed_example_invalid(size):
    (error,) = head_rule_errors(size, 40, 8, field="actor.backend", axis_name="context")
    assert f"context size {size} must divide num_attention_heads=40" in error
    assert "valid context sizes for this model: 1, 2, 4, 8, 40" in error


def test_head_rule_matches_brute_force_definition():
    for heads in range(1, 33):
        for kv in [k for k in range(1, heads + 1) if heads % k == 0]:
            for size in range(1, heads + 1):
                ok = heads % size == 0 and (kv % size == 0 or size % kv == 0)
                errors = head_rule_errors(size, heads, kv, field="f", axis_name="tensor")
                assert (errors == []) == ok
                assert (size in valid_head_sizes(heads, kv)) == ok


def test_head_rule_kv_heads():
    # 16 divides 32 heads and is a multiple of 8 KV heads (KV heads replicated): valid.
    assert head_rule_errors(16, 32, 8, field="f", axis_name="tensor") == []
    # 6 divides 12 heads but neither divides nor is a multiple of 4 KV heads.
    assert len(head_rule_errors(6, 12, 4, field="f", axis_name="tensor")) == 1
    # No KV-head count given: every head is its own KV head.
    assert head_rule_errors(4, 8, None, field="f", axis_name="tensor") == []
