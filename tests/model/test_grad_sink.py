"""Weight gradients through a GradSink == autograd's gradients folded into fp32 accumulators."""

from __future__ import annotations

import pytest
import torch
from lean_cases import _hf_mlp, _lean_copy
from patch_cases import RecordingSink, _stack_gate_up
from roundpipe_cases import STAGED, assert_same_masters, assert_same_step, make_steps, settings, tied_model

from laden.engine.roundpipe import RoundPipeEngine, residency
from laden.model.patches.grad_sink import accumulate_product, attach_sink, sink_of, suspended
from laden.model.patches.lean_mlp import enable_lean_mlp
from laden.model.patches.options import EAGER, PatchOptions
from laden.model.patches.sink_linear import enable_sink_linears
from laden.model.patches.stacked import stacked_rows
from laden.model.patches.tiled import enable_tiled_mlp

pytestmark = pytest.mark.usefixtures("one_thread")


def _bf16_lean_mlp(options: PatchOptions = EAGER, **config):
    return _lean_copy(_hf_mlp(**config), options=options).to(torch.bfloat16)


def _micro_batches(count: int = 3):
    gen = torch.Generator().manual_seed(2)
    return [
        (torch.randn(2, 5, 16, generator=gen), torch.randn(2, 5, 16, generator=gen)) for _ in range(count)
    ]


def _fp32_sums_of_autograd_grads(mlp) -> dict[str, torch.Tensor]:
    """What an engine's hook path accumulates: each micro-batch's bf16 `.grad` added into fp32."""
    sums = {n: torch.zeros(p.shape) for n, p in mlp.named_parameters()}
    for x, g in _micro_batches():
        mlp.zero_grad()
        mlp(x.to(torch.bfloat16).requires_grad_()).backward(g.to(torch.bfloat16))
        for n, p in mlp.named_parameters():
            sums[n].add_(p.grad)
    return sums


@pytest.mark.parametrize("bias", [False, True])
def test_lean_mlp_weight_gradients_go_to_their_sinks(bias):
    """With sinks on the three projection weights, the lean MLP leaves their `.grad` empty and its
    sinks hold exactly the fp32 sums of what autograd would have written (the CPU path computes the
    product in bf16 and adds it, as the fold does); biases and the input get gradients as before."""
    plain, sunk = _bf16_lean_mlp(mlp_bias=bias), _bf16_lean_mlp(mlp_bias=bias)
    want = _fp32_sums_of_autograd_grads(plain)
    weights = {n: p for n, p in sunk.named_parameters() if n.endswith("weight")}
    sinks = {n: RecordingSink(p) for n, p in weights.items()}
    for n, p in weights.items():
        attach_sink(p, sinks[n])
    bias_sums = {n: torch.zeros(p.shape) for n, p in sunk.named_parameters() if n.endswith("bias")}
    for x, g in _micro_batches():
        sunk.zero_grad()
        leaf = x.to(torch.bfloat16).requires_grad_()
        sunk(leaf).backward(g.to(torch.bfloat16))
        assert leaf.grad is not None
        assert all(p.grad is None for p in weights.values())
        for n in bias_sums:
            bias_sums[n].add_(dict(sunk.named_parameters())[n].grad)
    assert sorted(weights) == ["down_proj.weight", "gate_proj.weight", "up_proj.weight"]
    for n, sink in sinks.items():
        assert sink.calls == 3, n
        torch.testing.assert_close(sink.acc, want[n], rtol=0, atol=0, msg=n)
    for n, total in bias_sums.items():
        torch.testing.assert_close(total, want[n], rtol=0, atol=0, msg=n)


def test_a_tiled_lean_mlp_returns_its_gradients_once_per_backward():
    """Inside the tiled MLP the sinks are suspended: the tiles' gradients are summed and written once,
    as autograd's one gradient per backward, and the sinks see nothing."""
    mlp = _bf16_lean_mlp()
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([torch.nn.Module()])
    holder.layers[0].mlp = mlp
    assert enable_tiled_mlp(holder, tile_tokens=4) == 1
    sinks = [RecordingSink(p) for p in mlp.parameters()]
    for p, sink in zip(mlp.parameters(), sinks):
        attach_sink(p, sink)
    x = torch.randn(1, 10, 16, dtype=torch.bfloat16, requires_grad=True)
    mlp(x * 1).sum().backward()
    assert all(sink.calls == 0 for sink in sinks)
    assert all(p.grad is not None for p in mlp.parameters())


def test_suspended_hides_sinks_in_this_thread_only():
    weight = torch.nn.Parameter(torch.zeros(2, 2))
    sink = RecordingSink(weight)
    attach_sink(weight, sink)
    assert sink_of(weight) is sink
    with suspended():
        assert sink_of(weight) is None
        with suspended():
            assert sink_of(weight) is None
        assert sink_of(weight) is None
    assert sink_of(weight) is sink


def lean_model(options: PatchOptions = EAGER):
    model = tied_model()
    enable_lean_mlp(model, options=options)
    enable_sink_linears(model, options=options)
    return model


@pytest.mark.parametrize("swiglu", ["eager", "fused"])
@pytest.mark.parametrize("plan", ["one_stage", "staged", "staged_layer_grain"])
def test_engine_with_sinks_equals_engine_with_gradient_hooks(plan, swiglu, monkeypatch):
    """bf16 compute, fp32 masters, lean MLPs and sink projections: the residency's sinks (the MLP
    and attention projection weights' gradients added into their fp32 accumulators by the modules) train exactly as autograd's gradients folded by
    the post-accumulate hooks, one stage (early downloads count the sinks' writes) or staged. On CUDA
    the sinks are held to the fold's arithmetic (the bf16 product, then an fp32 add): their one
    fp32-output GEMM is closer than the fold, so not bit-equal (its own test is below). With the
    fused SwiGLU backward (run eagerly here), each layer's gate and up weights, back to back in the
    upload, send their gradients to their stacked accumulators in one GEMM (a joint sink)."""
    from laden.model.patches import fused, grad_sink

    monkeypatch.setattr(grad_sink, "_fp32_out_addmm", lambda device, dtype: False)
    options = EAGER
    if swiglu == "fused":  # with joint projections (off by default)
        options = PatchOptions(fused=True, joint_projections=True)
        monkeypatch.setattr(fused, "call", lambda fn, *args, options: fn(*args))
    joint_calls: list[list[int]] = []
    joint_accumulate = residency._JointAccumulatorSink.accumulate

    def joint_spy(self, grad_out, inp, weight_dtype):
        joint_calls.append(self.indices)
        joint_accumulate(self, grad_out, inp, weight_dtype)

    monkeypatch.setattr(residency._JointAccumulatorSink, "accumulate", joint_spy)
    o = settings(gradient_clipping=0.05)
    execute_plan = None if plan == "one_stage" else STAGED
    calls: list[int] = []
    accumulate = residency._AccumulatorSink.accumulate

    def spy(self, grad_out, inp, weight_dtype):
        calls.append(self.index)
        accumulate(self, grad_out, inp, weight_dtype)

    monkeypatch.setattr(residency._AccumulatorSink, "accumulate", spy)
    writes: list[int] = []  # the writes the residency counted (early downloads wait for them)
    count_write = residency._count_write
    monkeypatch.setattr(
        residency, "_count_write", lambda res, index: writes.append(index) or count_write(res, index)
    )
    grain = "layer" if plan == "staged_layer_grain" else "stage"  # recomputed layer by layer
    sunk = RoundPipeEngine(lean_model(options), optim=o, compute_dtype=torch.bfloat16, execute_plan=execute_plan,
                           recompute_grain=grain)  # fmt: skip
    monkeypatch.setattr(residency, "SINK_WEIGHT_GRADS", False)
    hooked = RoundPipeEngine(lean_model(options), optim=o, compute_dtype=torch.bfloat16, execute_plan=execute_plan,
                             recompute_grain=grain)  # fmt: skip
    assert (len(sunk.plan.bwd_plan) == 1) == (plan == "one_stage")
    for mbs in make_steps(2):  # 3 micro-batches per step
        n = sum(mb.num_loss_tokens for mb in mbs)
        monkeypatch.setattr(residency, "SINK_WEIGHT_GRADS", True)
        writes.clear()
        got = sunk.train_batch(mbs, global_num_loss_tokens=n)
        sunk_writes = sorted(writes)
        monkeypatch.setattr(residency, "SINK_WEIGHT_GRADS", False)
        before = len(calls)
        writes.clear()
        assert_same_step(got, hooked.train_batch(mbs, global_num_loss_tokens=n))
        assert len(calls) == before  # the hooked engine used none
        assert sunk_writes == sorted(writes)  # every sink write counted once, as a hook counts
    # (3 MLP + 4 attention projection weights) x 3 decoder layers x 3 micro-batches per step, 2 steps;
    # gate and up as one joint sink with the fused SwiGLU
    joint = swiglu == "fused"
    assert len(calls) == (3 - 2 * joint + 4) * 3 * 3 * 2
    assert len(joint_calls) == joint * 3 * 3 * 2 and all(len(i) == 2 for i in joint_calls)
    assert_same_masters(sunk, hooked)


@pytest.mark.gpu
def test_cuda_sinks_accumulate_in_one_fp32_output_gemm():
    """On CUDA the product is added by one addmm with an fp32 output: the sum equals the fp32
    product of the bf16 factors to fp32 rounding, closer than the bf16-rounded gradient's sum."""
    from laden.model.patches import grad_sink

    gen = torch.Generator(device="cuda").manual_seed(0)
    g = torch.randn(4096, 768, device="cuda", dtype=torch.bfloat16, generator=gen)
    x = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    assert grad_sink._fp32_out_addmm(g.device, torch.bfloat16)
    acc = torch.zeros(768, 256, device="cuda")
    for _ in range(2):
        accumulate_product(acc, g, x, torch.bfloat16)
    exact = 2 * (g.double().t() @ x.double())
    rounded = 2 * (g.t() @ x).double()  # what the fold adds: the gradient rounded to bf16 first
    err, rounded_err = (acc.double() - exact).abs().max(), (rounded - exact).abs().max()
    assert err <= 1e-5 * exact.abs().max()
    assert err < rounded_err


class StackedSinks:
    """Recording sinks whose accumulators are rows of one fp32 buffer, and which join into one."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        flat = torch.zeros(sum(w.numel() for w in weights))
        joinable = type("JoinableSink", (RecordingSink,), {"join": staticmethod(self.join)})
        self.sinks, offset = [], 0
        for w in weights:
            sink = joinable(w)
            sink.acc = flat[offset : offset + w.numel()].view(w.shape)
            self.sinks.append(sink)
            offset += w.numel()
        self.joint_calls = 0

    def join(self, sinks):
        acc = stacked_rows([s.acc for s in sinks])
        assert acc is not None
        outer = self

        class Joint:
            def accumulate(self, grad_out, inp, weight_dtype) -> None:
                accumulate_product(acc, grad_out, inp, weight_dtype)
                outer.joint_calls += 1

        return Joint()


@pytest.mark.parametrize("fused_path", [False, True], ids=["eager_swiglu", "fused_swiglu"])
def test_stacked_gate_and_up_are_one_gemm_and_their_sinks_one_when_they_join(fused_path, monkeypatch):
    """bf16 lean MLP with gate and up weights back to back: one forward GEMM for both; with the
    fused SwiGLU backward (run eagerly here) both gradients come side by side, the input gradient
    is one GEMM over them and stacked accumulators take both weight gradients in one GEMM.
    Outputs, input gradients and the accumulated weight gradients are autograd's to bf16 rounding."""
    from laden.model.patches import fused, lean_mlp

    if fused_path:
        monkeypatch.setattr(fused, "call", lambda fn, *args, options: fn(*args))
    linear = torch.nn.functional.linear
    gemms: list[tuple[int, ...]] = []
    monkeypatch.setattr(
        lean_mlp.F, "linear", lambda x, w, b=None: gemms.append(tuple(w.shape)) or linear(x, w, b)
    )
    joint_on = PatchOptions(fused=fused_path, joint_projections=True)  # joint projections: off by default
    plain, sunk = _bf16_lean_mlp(), _bf16_lean_mlp(joint_on)
    _stack_gate_up(sunk)
    want = _fp32_sums_of_autograd_grads(plain)
    stacked_sinks = StackedSinks([sunk.gate_proj.weight, sunk.up_proj.weight])
    for p, sink in zip((sunk.gate_proj.weight, sunk.up_proj.weight), stacked_sinks.sinks):
        attach_sink(p, sink)
    for x, g in _micro_batches():
        gemms.clear()
        leaf = x.to(torch.bfloat16).requires_grad_()
        out = sunk(leaf)
        inter = sunk.up_proj.weight.shape[0]
        assert gemms == [(2 * inter, 16), (16, inter)]  # gate and up as one [2I, H] GEMM, then down
        out.backward(g.to(torch.bfloat16))
        ref_leaf = x.to(torch.bfloat16).requires_grad_()
        ref = plain(ref_leaf)
        ref.backward(g.to(torch.bfloat16))
        torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1.6e-2, atol=1e-2)
    assert stacked_sinks.joint_calls == (3 if fused_path else 0)
    assert all(s.calls == (0 if fused_path else 3) for s in stacked_sinks.sinks)
    for name, sink in zip(("gate_proj.weight", "up_proj.weight"), stacked_sinks.sinks):
        torch.testing.assert_close(sink.acc, want[name], rtol=1.6e-2, atol=1e-2, msg=name)
