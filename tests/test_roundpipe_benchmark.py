"""benchmarks/train_throughput.py runs on the CPU with the tiny model and prints one JSON result."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "train_throughput.py"


def load_script():
    spec = importlib.util.spec_from_file_location("train_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.mark.parametrize("system", ["laden", "plain"])
def test_train_throughput_runs_on_cpu_with_tiny_model(system, capsys):
    bench = load_script()
    result = bench.main(["--system", system, "--model", "tiny", "--steps", "1", "--warmup", "1",
                         "--seq-len", "32", "--num-seqs", "4", "--num-microbatch", "2"])  # fmt: skip
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == result
    for key in ("name", "model", "shape", "tokens_per_s", "mfu", "hfu", "peak_host_gib", "git_commit", "device",
                "torch", "transformers"):  # fmt: skip
        assert key in result, key
    assert result["name"] == f"train_throughput/{system}" and result["device"] == "cpu"
    assert result["tokens_per_s"] > 0 and math.isfinite(result["last_loss"])
    expected_mfu = 6 * result["num_params"] * result["tokens_per_s"] / 989e12
    assert result["mfu"] == pytest.approx(expected_mfu, abs=1e-4)
    assert result["hfu"] == pytest.approx(expected_mfu * 8 / 6, abs=1e-4)


def test_tiny_layers_give_the_reference_plan_shape_on_cpu(capsys):
    """`--tiny-layers` with the reference plan's stage sizes: the H200 run's schedule (one forward
    stage, a fused stage, single-layer backward stages) at negligible compute, a CPU measure of
    the host work per step."""
    bench = load_script()
    result = bench.main(["--system", "laden", "--model", "tiny", "--tiny-layers", "5", "--steps", "1",
                         "--warmup", "1", "--seq-len", "8", "--num-seqs", "4", "--num-microbatch", "2",
                         "--stage-layers", "1", "--fused-layers", "3", "--fwd-stage-layers", "4"])  # fmt: skip
    assert result["plan"] == (
        "ModelExecutePlan(fwd_plan=[range(0, 4)], bwd_plan=[range(4, 7), range(3, 4), range(2, 3), "
        "range(1, 2), range(0, 1)])"
    )  # 5 decoder layers + embedding + head
    assert math.isfinite(result["last_loss"])


@pytest.mark.parametrize("system", ["laden", "plain"])
def test_non_finite_loss_fails_loudly(system, capsys, monkeypatch):
    """A NaN in the final norm's weight makes every loss NaN: the result is printed, marked invalid,
    and the script exits non-zero naming the first bad step (how the H200 NaN run should have ended)."""
    bench = load_script()
    real_build = bench.build_model

    def poisoned(args):
        model = real_build(args)
        with torch.no_grad():
            model.model.norm.weight[0] = float("nan")
        return model

    monkeypatch.setattr(bench, "build_model", poisoned)
    with pytest.raises(SystemExit, match="loss is not finite from step 0") as exit_info:
        bench.main(["--system", system, "--model", "tiny", "--steps", "1", "--warmup", "1",
                    "--seq-len", "32", "--num-seqs", "4", "--num-microbatch", "2"])  # fmt: skip
    assert exit_info.value.code not in (0, None)
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["valid"] is False and printed["problems"]
    assert not math.isfinite(printed["last_loss"])


def test_pinned_allocator_bytes_reads_the_flattened_host_stats():
    """`torch.cuda.host_memory_stats()` keys are `allocated_bytes.<metric>` (no `reserved_bytes`)."""
    bench = load_script()
    stats = {"allocated_bytes.current": 3 << 30, "allocated_bytes.peak": 5 << 30, "allocations.current": 7}
    assert bench.pinned_allocator_bytes(stats) == 5 << 30
    assert bench.pinned_allocator_bytes({"allocated_bytes": {"current": 1 << 20}}) == 1 << 20
    assert bench.pinned_allocator_bytes({}) == 0


def test_profile_busy_time_is_the_union_of_intervals():
    union = load_script()._union_seconds
    assert union([]) == 0
    assert union([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == pytest.approx(3.0)  # overlap counted once
    assert union([(3.0, 4.0), (0.0, 10.0)]) == pytest.approx(10.0)  # nested, unsorted


@pytest.mark.parametrize("mode", ["alloc", "register", "off"])
def test_pin_model_benchmark_runs_the_upload_path_on_cpu(mode, capsys):
    """benchmarks/pin_model.py builds the engine and uploads every layer through `upload_stage`."""
    import sys

    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("pin_model", SCRIPT.parent / "pin_model.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    result = bench.main(["--model", "tiny", "--pin-model", mode, "--repeats", "1"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert result["valid"] and result["pin_model"] == mode and result["build_s"] >= 0
    # every parameter's bf16-or-fp32 upload copy, counted once: at least the parameters' own bytes in bf16
    assert result["upload_bytes"] >= 2 * result["num_params"]
    assert result["upload_gb_s"] is None and result["uploads_pinned"] is None  # no GPU here


def test_long_context_knob_is_recorded_in_the_result(capsys):
    """--tiled-mlp-tokens (actor.tiled_mlp_tokens) tiles every MLP and makes every RMSNorm lean, and
    --lean-activations (on by default for laden) makes RMSNorms and gated MLPs lean; the result says
    how many, so a run where a model family was left alone shows it."""
    bench = load_script()
    args = ["--model", "tiny", "--steps", "1", "--warmup", "0", "--seq-len", "32", "--num-seqs", "1",
            "--num-microbatch", "1", "--recompute-grain", "layer"]  # fmt: skip
    plain = bench.main([*args, "--no-lean-activations"])
    tiled = bench.main([*args, "--no-lean-activations", "--tiled-mlp-tokens", "8"])
    lean = bench.main(args)  # laden's default: actor.lean_activations
    num_layers = 2  # laden.model.tiny
    assert (plain["tiled_mlps"], plain["lean_rmsnorms"], plain["lean_mlps"]) == (0, 0, 0)
    assert tiled["tiled_mlps"] == num_layers and tiled["lean_rmsnorms"] == 4 * num_layers + 1
    assert (lean["tiled_mlps"], lean["lean_rmsnorms"], lean["lean_mlps"]) == (
        0,
        4 * num_layers + 1,
        num_layers,
    )
    for run in (tiled, lean):
        assert run["last_loss"] == pytest.approx(plain["last_loss"], rel=1e-5)


def test_kernel_categories_of_profiled_kernel_names():
    category = load_script().kernel_category
    names = {  # kernel names as the H200 profile of the reference workload printed them
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kerne": "attention",
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT": "gemm",
        "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<a": "elementwise",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda": "copy_cast",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>": "reduction",
        "some_unknown_kernel": "other",
    }
    assert {name: category(name) for name in names} == names


def test_attention_flops_follow_the_causal_count():
    """6 S q per token and layer (forward 2 S q, backward twice that), 8 S q with the recomputed
    forward; q = heads x head_dim, or the hidden size when the config has no head_dim."""
    from types import SimpleNamespace

    flops = load_script().attention_flops_per_token
    config = SimpleNamespace(num_attention_heads=16, head_dim=128, hidden_size=2048, num_hidden_layers=28)
    assert flops(config, 4096, 6) == 6 * 4096 * 16 * 128 * 28
    assert flops(config, 4096, 8) / flops(config, 4096, 6) == pytest.approx(8 / 6)
    no_head_dim = SimpleNamespace(num_attention_heads=4, head_dim=None, hidden_size=256, num_hidden_layers=2)
    assert flops(no_head_dim, 10, 6) == 6 * 10 * 256 * 2


def test_gaps_are_explained_by_the_copies_and_host_calls_inside_them():
    ms = 1e-3
    kernels = [(0.0, 1 * ms, "a"), (1.5 * ms, 2 * ms, "b"), (6 * ms, 7 * ms, "c")]
    copies = [(2.5 * ms, 5.5 * ms, "Memcpy DtoH (Device -> Pinned)"), (6.5 * ms, 7 * ms, "Memcpy HtoD")]
    host = [
        (2.2 * ms, 5.9 * ms, "cudaEventSynchronize", 7),  # inside the long gap
        (3 * ms, 3.1 * ms, "cudaLaunchKernel", 1),  # too short to list
        (0.2 * ms, 0.9 * ms, "aten::mm", 1),  # during a kernel
    ]
    longest, shorter = load_script().explain_gaps(kernels, copies, host)
    assert longest["ms"] == 4.0 and (longest["after"], longest["before"]) == ("b", "c")
    assert longest["copies"] == [["Memcpy DtoH (Device -> Pinned)", 0.5, 3.5]]
    assert longest["host_calls"] == [["cudaEventSynchronize", 7, 0.2, 3.9]]
    assert shorter["ms"] == 0.5 and shorter["copies"] == [] and shorter["host_calls"] == []
