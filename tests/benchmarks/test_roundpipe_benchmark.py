"""benchmarks/train_throughput.py runs on the CPU with the tiny model and prints one JSON result;
the FLOP counts, the run records and the summary of the device drivers (run_core_h200.sh)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from benchmark_scripts import BENCH, SCRIPT, load_script

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--model", "tiny", "--steps", "1", "--warmup", "1", "--seq-len", "32", "--num-seqs", "4",
        "--num-microbatch", "2"]  # fmt: skip


def decoder_params() -> int:
    """Parameters of one decoder layer of the tiny model (tests/support/tiny.py: hidden 64, intermediate 128,
    4 heads of 16, 2 KV heads; q/k RMSNorms over head_dim, two layer norms)."""
    hidden, inter, head_dim, heads, kv_heads = 64, 128, 16, 4, 2
    attn = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    return attn + 3 * hidden * inter + 2 * head_dim + 2 * hidden


@pytest.mark.parametrize("system", ["laden", "fsdp", "plain"])
def test_train_throughput_runs_on_cpu_with_tiny_model(system, capsys):
    bench = load_script()
    result = bench.main(["--system", system, *TINY])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == result
    for key in ("name", "model", "shape", "tokens_per_s", "mfu", "hfu", "peak_host_gib", "git_commit", "device",
                "torch", "transformers", "mode", "engine", "alloc_conf"):  # fmt: skip
        assert key in result, key
    assert result["name"] == f"train_throughput/{system}" and result["device"] == "cpu"
    assert result["tokens_per_s"] > 0 and math.isfinite(result["last_loss"])
    expected_mfu = 6 * result["num_params"] * result["tokens_per_s"] / 989e12
    assert result["mfu"] == pytest.approx(expected_mfu, abs=1e-4)
    assert result["hfu_8n"] == pytest.approx(expected_mfu * 8 / 6, abs=1e-4)
    # Nothing recomputed: laden's tiny model fits whole (one fused stage); no checkpointing for the others.
    assert result["recomputed_layers"] == 0 and result["hfu"] == result["mfu"]
    assert result["mode"] == (
        "async (one-step-stale) step, clip 1" if system == "laden" else "sync step, clip 1"
    )


def test_fsdp_system_is_built_by_the_engine_factory_with_the_runtime_patches(capsys):
    """--system fsdp: a LadenConfig with actor.backend fsdp:d1 through laden.engine.factory, the model
    patched as `laden sft` patches it (lean RMSNorms and MLPs), fp32 masters."""
    result = load_script().main(["--system", "fsdp", *TINY])
    assert result["engine"] in ("FSDPEngine", "LocalEngine")  # LocalEngine: before fsdp:d1 became FSDPEngine
    assert result["patches_api"] in ("laden.model.patches.apply.apply_patches",
                                     "laden.sft.trainer.apply_activation_knobs")  # fmt: skip
    assert (result["lean_mlps"], result["lean_rmsnorms"]) == (2, 4 * 2 + 1)
    assert result["shape"]["optimizer_dtype"] == "float32" and result["shape"]["optim_step"] == "sync"


@pytest.mark.parametrize("system", ["fsdp", "plain"])
def test_gradient_checkpointing_counts_every_decoder_layer_in_hfu(system, capsys):
    """With checkpointing every decoder layer's forward runs twice: HFU counts 2 x the decoder layers'
    parameters on top of 6 N (the embedding and head are not recomputed, so it stays below 8 N)."""
    result = load_script().main(["--system", system, *TINY, "--gradient-checkpointing"])
    assert result["shape"]["gradient_checkpointing"] is True and result["problems"] == []
    assert result["recomputed_layers"] == 2
    assert result["recomputed_params"] == 2 * decoder_params()  # HFU's formula: test_utilisation_...


def test_plain_is_stock_hugging_face_and_imports_no_laden_module():
    """--system plain in a fresh interpreter: stock Hugging Face training, and `laden` never imported."""
    env = dict(
        os.environ, PYTHONPATH=str(SCRIPT.parent.parent), OMP_NUM_THREADS="1"
    )  # as the other tests here
    proc = subprocess.run([sys.executable, str(SCRIPT), "--system", "plain", *TINY], capture_output=True,
                          text=True, env=env, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["valid"] and result["laden_imported"] is False
    assert result["engine"] == "PlainHF" and result["shape"]["optimizer"] == "torch.optim.AdamW(fused=True)"
    assert result["lean_mlps"] is None and result["shape"]["attn"] == "sdpa"


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
    # HFU from the plan: the backward stages after the fused one recompute the embedding (no FLOPs)
    # and decoder layers 1 to 3; the fused stage (decoder layers 4 and 5, the head) does not.
    assert result["recomputed_layers"] == 4 and result["recomputed_params"] == 3 * decoder_params()


@pytest.mark.parametrize("system", ["laden", "fsdp", "plain"])
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


def test_out_of_memory_is_printed_as_an_invalid_result(capsys, monkeypatch):
    """A GPU OOM (checkpointing off may not fit) ends in a JSON result with error_kind gpu_oom and a
    non-zero exit, so the driver records it and the summary reports it instead of dropping it."""
    bench = load_script()

    def oom(args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(bench, "run", oom)
    with pytest.raises(SystemExit, match="gpu_oom"):
        bench.main(["--system", "plain", *TINY, "--no-gradient-checkpointing"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (
        printed["valid"] is False and printed["error_kind"] == "gpu_oom" and printed["tokens_per_s"] is None
    )
    assert printed["shape"]["gradient_checkpointing"] is False and printed["system"] == "plain"
    assert bench.oom_kind(RuntimeError("DefaultCPUAllocator: can't allocate memory: 8 GiB")) == "host_oom"
    assert bench.oom_kind(RuntimeError("shape mismatch")) is None


def test_laden_refuses_a_gradient_checkpointing_flag():
    with pytest.raises(SystemExit):
        load_script().parse_args(["--system", "laden", "--gradient-checkpointing"])


def test_utilisation_counts_the_recompute_of_each_step_plan():
    """bench_common.utilisation: MFU = 6 N; HFU adds 2 x the parameters (and 2 S q of attention per
    decoder layer) of every recomputed layer, averaged over the timed steps' plans."""
    common = load_script(BENCH / "bench_common.py")
    recomputed_layers, utilisation = common.recomputed_layers, common.utilisation
    layer_params = [0, 10, 10, 5]  # embedding, two decoder layers, head
    fields = dict(tokens_per_s=989e12 / 100, num_params=25, layer_params=layer_params, attn_fwd_flops=4.0)
    none = utilisation(recomputed=[[]], **fields)
    assert none["mfu"] == none["hfu"] == 1.5 and none["hfu_8n"] == 2.0
    assert none["mfu_attn"] == none["hfu_attn"] == pytest.approx((150 + 3 * 4 * 2) / 100)
    every = utilisation(recomputed=[[0, 1, 2]], **fields)  # embedding + both decoder layers
    assert every["hfu"] == pytest.approx((150 + 2 * 20) / 100) and every["recomputed_params"] == 20
    assert every["hfu_attn"] == pytest.approx((190 + 4 * 4 * 2) / 100)
    mean = utilisation(recomputed=[[1], [1, 2]], **fields)  # two plans: 1 and 2 decoder layers
    assert mean["recomputed_layers"] == 1.5 and mean["hfu"] == pytest.approx((150 + 2 * 15) / 100)
    assert utilisation(recomputed=None, **fields)["hfu"] is None
    with pytest.raises(ValueError, match="outside"):
        utilisation(recomputed=[[4]], **fields)
    plan = [range(3, 5), range(1, 3), range(0, 1)]  # bwd_plan: the fused stage first
    assert recomputed_layers(plan) == [0, 1, 2]
    assert recomputed_layers(plan, fused_stage_recomputes=True) == [0, 1, 2, 3, 4]


def test_layer_forward_params_of_a_tied_model():
    """The head's matmul counts though its weight is the embedding's; the lookup counts nothing, so
    the layers sum to N for a tied model."""
    from tiny import tiny_qwen3_config
    from transformers import AutoModelForCausalLM

    config = tiny_qwen3_config(vocab_size=128)
    config.tie_word_embeddings = True
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = load_script(BENCH / "bench_common.py").layer_forward_params(model)
    assert params[0] == 0 and len(params) == 2 + 2
    assert params[1] == params[2] == decoder_params()
    assert sum(params) == sum(p.numel() for p in model.parameters())


def test_roundpipe_ref_budgets():
    """roundpipe_ref's planner budget: RoundPipe's default on a card of the cap (0.6 x 24 GiB), its
    number as given, RoundPipe's own default with 0, laden's 22 GiB in the same bytes (RoundPipe
    counts layer bytes in GB); run facts name the step and the allocator."""
    ref = load_script(BENCH / "roundpipe_ref.py")
    assert ref.memory_limit_gb(ref.parse_args([])) == 14.4
    assert ref.memory_limit_gb(ref.parse_args(["--model-memory-limit", "22"])) == 22
    assert ref.memory_limit_gb(ref.parse_args(["--model-memory-limit", "0"])) is None
    assert ref.memory_limit_gb(ref.parse_args(["--model-memory-limit-gib", "22"])) == 23.622  # GB, its unit
    with pytest.raises(SystemExit):  # one budget or the other
        ref.parse_args(["--model-memory-limit", "22", "--model-memory-limit-gib", "22"])
    facts = ref.run_facts(ref.parse_args([]))
    assert facts["mode"] == "async (one-step-stale) step, no clip" and "alloc_conf" in facts


def test_bench_record_classifies_runs():
    """bench_record: a script's own result stands (plus run facts); no result gives an error line
    whose kind comes from the exit status and output."""
    record = load_script(BENCH / "bench_record.py").record
    ok = json.dumps({"valid": True, "tokens_per_s": 5.0})
    kept = record("a", "0", 100, 10, f"noise\n{ok}\n", "", ["python3", "x.py"])
    assert (
        kept["valid"]
        and kept["tokens_per_s"] == 5.0
        and (kept["run"], kept["rc"], kept["cmd"]) == ("a", 0, "python3 x.py")
    )
    assert record("b", "124", 100, 100, "", "", [])["error_kind"] == "timeout"
    assert (
        record("c", "1", 100, 5, "", "torch.OutOfMemoryError: CUDA out of memory", [])["error_kind"]
        == "gpu_oom"
    )
    assert record("d", "137", 100, 5, "", "", [])["error_kind"] == "host_oom"  # killed before its limit
    assert record("e", "skipped", 0, 0, "", "", [])["rc"] is None
    own = json.dumps({"valid": False, "error_kind": "no_gpu", "error": "needs a GPU"})
    assert record("f", "1", 100, 5, own, "", [])["error_kind"] == "no_gpu"  # the script's own kind stands


def _line(run: str, tok_s: float | None, **extra) -> dict:
    if tok_s is None:
        return {"run": run, "valid": False, "tokens_per_s": None, "error_kind": "gpu_oom", **extra}
    return {"run": run, "valid": True, "tokens_per_s": tok_s, **extra}


def test_core_summary_best_of_each_system_and_ratios():
    summarize = load_script(BENCH / "core_summary.py").summarize
    results = [
        _line("fsdp_gc_off", None), _line("fsdp_gc_off_mb8", 30.0), _line("fsdp_gc_on", 25.0),
        _line("plain_gc_off", 15.0), _line("plain_gc_on", 20.0), _line("laden_sync", 24.0),
        _line("laden_async", 36.0), _line("rp_mb4_lim22", 20.0, shape={"num_microbatch": 4}),
        _line("rp_mb2_lim14.4", None), _line("rp_mb8_lim22", 22.5), {"run": "pytest", "valid": True},
    ]  # fmt: skip
    summary = summarize(results)
    groups = summary["groups"]
    assert groups["fsdp"]["best"]["run"] == "fsdp_gc_off_mb8" and groups["fsdp"]["valid_runs"] == 2
    assert [p["error_kind"] for p in groups["fsdp"]["points"] if p["tokens_per_s"] is None] == ["gpu_oom"]
    assert groups["roundpipe"]["best"]["tokens_per_s"] == 22.5 and len(groups["roundpipe"]["points"]) == 3
    assert groups["roundpipe"]["points"][0]["num_microbatch"] == 4
    ratios = summary["ratios"]
    assert ratios["fsdp_over_laden_sync"] == pytest.approx(30 / 24, abs=1e-4)
    assert ratios["laden_async_over_roundpipe"] == pytest.approx(36 / 22.5, abs=1e-4)
    assert ratios["fsdp_over_plain"] == pytest.approx(1.5)
    assert "new_over_old" not in ratios and "regression" not in summary


def test_core_summary_old_against_new_uses_means_and_pairs():
    summarize = load_script(BENCH / "core_summary.py").summarize
    results = [_line("old_ref_1", 100.0), _line("new_ref_1", 99.0), _line("new_ref_2", 95.0),
               _line("old_ref_2", 100.0), _line("old_ref_3", 100.0), _line("new_ref_3", None)]  # fmt: skip
    summary = summarize(results)
    assert summary["ratios"]["new_over_old"] == pytest.approx(97 / 100)
    assert summary["pair_ratios_new_over_old"] == [0.99, 0.95]  # the failed third pair has no ratio
    assert summary["regression"] is False  # 3 % slower is within the tolerance
    slower = summarize([_line("old_ref_1", 100.0), _line("new_ref_1", 96.0)])
    assert slower["regression"] is True
