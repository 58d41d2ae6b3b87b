"""`apply_patches`: the activation knobs on one model, its report and log lines, and patched models under
FSDP2 and tensor parallelism (a world of one, in this process) training like the plain model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from tiled_cases import _assert_model_same, _batch, _lm_step
from tiny import tiny_qwen3_config
from transformers import AutoModelForCausalLM

from laden.model.patches import fused
from laden.model.patches.apply import PatchReport, apply_patches
from laden.model.patches.fused_rotary import RotaryFn, rotary_options
from laden.model.patches.lean_mlp import is_lean_mlp
from laden.model.patches.options import PatchOptions, options_of
from laden.model.patches.sink_linear import is_sink_linear
from laden.model.patches.tiled import tile_tokens_of

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_LAYERS = 2
NUM_NORMS = 4 * NUM_LAYERS + 1  # input, post-attention, q and k norms per layer; the final norm


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_qwen3_config(vocab_size=48, num_hidden_layers=NUM_LAYERS)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.fixture
def eager_compile(monkeypatch) -> list[str]:
    """The fused functions run as eager ops (the names of those handed to the compiler, in order)."""
    compiled: list[str] = []
    monkeypatch.setattr(fused, "_compiled", lambda fn, static: compiled.append(fn.__name__) or fn)
    return compiled


def _report(**knobs) -> tuple[torch.nn.Module, PatchReport]:
    model = _model()
    args = {"lean_activations": True, "fused_elementwise": False, "tiled_mlp_tokens": None} | knobs
    return model, apply_patches(model, **args)


def test_lean_and_fused_patch_every_layer_with_the_models_options(eager_compile):
    """Lean norms, MLPs and sink projections and the fused rotary in every layer, each module with
    the model's options; a training step equals the plain model's, through the fused functions."""
    plain = _model()
    want = _lm_step(plain, _batch())
    model, report = _report(fused_elementwise=True, static_last_dims=False)
    options = PatchOptions(fused=True, static_last_dims=False)
    assert report.options == options and report.skipped == ()
    assert (report.lean_norms, report.lean_mlps, report.sink_attention_layers) == (NUM_NORMS, 2, 2)
    assert (report.fused_rotary_layers, report.tiled_mlps, report.tile_tokens) == (2, 0, None)
    layer = model.model.layers[0]
    assert options_of(layer.input_layernorm) == options and options_of(layer.mlp) == options
    assert is_lean_mlp(layer.mlp) and is_sink_linear(layer.self_attn.o_proj)
    assert rotary_options(layer.self_attn) == options
    _assert_model_same(_lm_step(model, _batch()), want)
    assert {"_norm_forward", "_norm_backward", "_swiglu", "_swiglu_backward", "_rope"} <= set(eager_compile)


def test_nothing_asked_nothing_patched():
    model, report = _report(lean_activations=False)
    assert (
        report.lean_norms,
        report.lean_mlps,
        report.sink_attention_layers,
        report.fused_rotary_layers,
    ) == (
        0,
        0,
        0,
        0,
    )
    assert report.describe("fsdp") == [] and report.describe("roundpipe") == []
    assert not any(type(m).__name__.startswith(("Lean", "Sink", "FusedRope")) for m in model.modules())


def test_the_sink_line_claims_fp32_accumulators_only_under_roundpipe():
    """The same report: under roundpipe the projections add into the engine's fp32 accumulators;
    under fsdp (or one device) the line says they run as nn.Linear and names no accumulator."""
    _, report = _report()
    roundpipe, fsdp = report.describe("roundpipe"), report.describe("fsdp")
    assert roundpipe[0] == fsdp[0] == f"actor.lean_activations: {NUM_NORMS} RMSNorms and 2 gated MLPs lean"
    assert roundpipe[1] == (
        "actor.lean_activations: the lean MLPs' and 2 attention layers' projections add their weight "
        "gradients straight into the roundpipe engine's fp32 accumulators (when it computes in a lower "
        "precision)"
    )
    assert fsdp[1] == (
        "actor.lean_activations: 2 attention layers' projections run as nn.Linear under fsdp "
        "(only the roundpipe engine gives them gradient sinks)"
    )
    assert not any("accumulator" in line for line in fsdp)
    assert not any("accumulator" in line for line in report.describe("local"))


def test_the_fused_and_joint_lines_say_what_runs_under_each_engine():
    _, report = _report(fused_elementwise=True, joint_projections=True)
    fused_line = (
        "actor.fused_elementwise: the lean modules' elementwise math and 2 attention layers' rotary "
        "embeddings run compiled (static last dimensions)"
    )
    assert fused_line in report.describe("fsdp") and fused_line in report.describe("roundpipe")
    assert report.describe("roundpipe")[-1].startswith("joint projections: query/key/value and gate/up")
    assert report.describe("fsdp")[-1] == (
        "joint projections: on, but no effect under fsdp (its weights never lie back to back): every "
        "projection runs as its own GEMM"
    )


def test_tiled_mlps_come_with_lean_norms_and_say_so():
    """Tiled MLPs without lean activations: lean norms (no fp32 copies) and one line for both; the
    tiles' MLPs differentiate with the sinks suspended, so the roundpipe line names only attention."""
    model, report = _report(lean_activations=False, tiled_mlp_tokens=8)
    assert (report.lean_norms, report.lean_mlps, report.tiled_mlps, report.tile_tokens) == (
        NUM_NORMS,
        0,
        2,
        8,
    )
    assert tile_tokens_of(model.model.layers[1].mlp) == 8
    assert report.describe("fsdp") == [
        f"actor.tiled_mlp_tokens=8: 2 decoder MLPs tiled, {NUM_NORMS} RMSNorms lean"
    ]
    _, both = _report(tiled_mlp_tokens=8)
    assert both.describe("roundpipe")[1].startswith(
        "actor.lean_activations: 2 attention layers' projections add"
    )


def test_what_cannot_work_is_reported_skipped_with_the_reason():
    """Under tensor parallelism the lean MLP and the sink projections would never run (DTensor hooks
    on every projection): not applied, listed as skipped; joint projections without a module that
    runs them likewise; a layer whose MLP is not Hugging Face's is named."""
    model, report = _report(tensor_parallel=True, joint_projections=True)
    assert (report.lean_norms, report.lean_mlps, report.sink_attention_layers) == (NUM_NORMS, 0, 0)
    assert not any(is_lean_mlp(layer.mlp) for layer in model.model.layers)
    assert [s.patch for s in report.skipped] == ["lean MLP", "sink projections", "joint projections"]
    lines = report.describe("fsdp")
    assert lines[0] == f"actor.lean_activations: {NUM_NORMS} RMSNorms and 0 gated MLPs lean"
    assert lines[1].startswith("skipped lean MLP: tensor parallelism hooks every MLP projection")
    _, report = _report(lean_activations=False, joint_projections=True)
    assert [s.patch for s in report.skipped] == ["joint projections"]
    assert "actor.lean_activations=true" in report.skipped[0].reason
    model = _model()
    model.model.layers[1].mlp = torch.nn.Sequential(torch.nn.Linear(64, 64))
    with pytest.warns(UserWarning, match="enable_lean_mlp left Sequential as is"):
        report = apply_patches(model, lean_activations=True, fused_elementwise=False, tiled_mlp_tokens=None)
    assert report.lean_mlps == 1
    assert report.skipped[0].patch == "lean MLP" and report.skipped[0].reason.startswith(
        "1 of 2 decoder layers"
    )


# --- under FSDP2 and tensor parallelism (a world of one in this process) ---------------------------


@pytest.fixture(scope="module")
def world_of_one():
    """A gloo process group of this one process (an in-memory store), and its 1-rank CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if started:
        dist.destroy_process_group()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(model: torch.nn.Module, num_steps: int = 2) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Loss and every full gradient of `num_steps` SGD steps on fixed batches."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    steps = []
    for step in range(num_steps):
        loss, grads = _lm_step(model, _batch(seed=step))
        steps.append((loss, {name: _full(g) for name, g in grads.items()}))
        optimizer.step()
    return steps


PATCHED = {"lean_activations": True, "fused_elementwise": True, "tiled_mlp_tokens": 7}


def test_patched_model_under_fsdp2_trains_like_the_plain_model(world_of_one, eager_compile):
    """Lean norms and MLPs, sink projections, fused rotary (eager kernels) and tiled MLPs on a tiny
    Qwen3, then FSDP2 (laden's per-layer `fully_shard`): two SGD steps give the unwrapped plain
    model's losses and gradients (fp32), through the lean and fused functions on gathered weights."""
    from laden.engine.parallel.parallelize import apply_fsdp

    plain = _model()
    want = _train(copy.deepcopy(plain))
    model = copy.deepcopy(plain)
    report = apply_patches(model, **PATCHED)
    assert (report.lean_mlps, report.fused_rotary_layers, report.tiled_mlps) == (2, 2, 2)
    apply_fsdp(model, model.model.layers, world_of_one, param_dtype=torch.float32,
               storage_dtype=torch.float32, offload_params=False, pin_memory=False)  # fmt: skip
    assert type(model.model.layers[0].mlp).__name__ == "TiledLeanQwen3MLP"
    rotations: list[int] = []
    apply = RotaryFn.apply
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RotaryFn, "apply", lambda *args: rotations.append(1) or apply(*args))
        got = _train(model)
    assert len(rotations) == 2 * NUM_LAYERS  # two steps
    assert {"_norm_forward", "_norm_backward", "_swiglu", "_swiglu_backward"} <= set(eager_compile)
    for g, w in zip(got, want):
        _assert_model_same(g, w)


def test_patched_model_under_tensor_parallelism_trains_like_the_plain_model(world_of_one, eager_compile):
    """The same under laden's tensor-parallel plan (DTensor norms and projections, a 1-rank mesh):
    lean norms run on DTensors (their fused calls eager), the rotary on the local q and k, the MLPs
    tiled; the lean MLP and sink projections are skipped as the report says."""
    from laden.engine.parallel.parallelize import apply_tensor_parallel

    plain = _model()
    want = _train(copy.deepcopy(plain))
    model = copy.deepcopy(plain)
    report = apply_patches(model, **PATCHED, tensor_parallel=True)
    assert [s.patch for s in report.skipped] == ["lean MLP", "sink projections"]
    apply_tensor_parallel(model, world_of_one)
    norm_calls: list[str] = []
    real_call = fused.call

    def spy(fn, *args, options):
        norm_calls.append(type(args[0]).__name__)
        return real_call(fn, *args, options=options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused, "call", spy)
        got = _train(model)
    assert "DTensor" in norm_calls  # the norms saw DTensors
    for g, w in zip(got, want):
        _assert_model_same(g, w)


def test_patched_model_under_the_roundpipe_engine_trains_like_the_plain_model(eager_compile, monkeypatch):
    """All patches with joint projections on, then the roundpipe engine (staged, fp32): two steps give
    the plain model's losses, gradient norms and master weights, and the attention layers run query,
    key and value as one GEMM on the uploaded weights, as the roundpipe log line says."""
    from roundpipe_cases import (
        STAGED,
        assert_same_masters,
        assert_same_step,
        make_steps,
        settings,
        tied_model,
    )

    from laden.engine.roundpipe import RoundPipeEngine
    from laden.model.patches.sink_linear import _JointLinearFn

    joint_calls: list[int] = []
    forward = _JointLinearFn.forward
    monkeypatch.setattr(
        _JointLinearFn,
        "forward",
        staticmethod(lambda ctx, *args: joint_calls.append(1) or forward(ctx, *args)),
    )
    patched = tied_model()
    report = apply_patches(patched, **PATCHED, joint_projections=True)
    assert any(line.startswith("joint projections: query/key/value") for line in report.describe("roundpipe"))
    engines = [
        RoundPipeEngine(model, optim=settings(), compute_dtype=torch.float32, execute_plan=STAGED)
        for model in (patched, tied_model())
    ]
    for mbs in make_steps(2):
        n = sum(mb.num_loss_tokens for mb in mbs)
        got, want = (engine.train_batch(mbs, global_num_loss_tokens=n) for engine in engines)
        assert_same_step(got, want)
    assert joint_calls  # the uploaded q/k/v weights lie back to back
    assert_same_masters(*engines)
