"""actor.fused_elementwise: the lean modules' elementwise math compiled (inductor, here its CPU backend).

Compiled == eager up to float rounding: the norm's forward and backward, the SwiGLU product and
its gradients, and a whole tiny Qwen3 training step, against plain PyTorch autograd. The choice
is per model (`PatchOptions` on the patched modules): two models in one process keep theirs.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from lean_cases import _hf_mlp, _holder, _tiny_model
from patch_cases import FUSED, fused  # noqa: F401  (the fixture)
from tiled_cases import _assert_model_same, _batch, _lm_step

from laden.model.patches import fused as fused_module
from laden.model.patches.lean_mlp import enable_lean_mlp
from laden.model.patches.lean_norm import LeanRMSNormFn, enable_lean_rmsnorm
from laden.model.patches.options import EAGER, PatchOptions


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Llama-style RMSNorm forward, under plain autograd."""
    x_f32 = x.to(torch.float32)
    variance = x_f32.pow(2).mean(-1, keepdim=True)
    return weight * (x_f32 * torch.rsqrt(variance + eps)).to(x.dtype)


@pytest.mark.parametrize(
    ("dtype", "tol"),
    [(torch.float32, {}), (torch.bfloat16, {"rtol": 2e-2, "atol": 2e-2})],
    ids=["fp32", "bf16"],
)
def test_fused_norm_matches_autograd(fused, dtype, tol):  # noqa: F811
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 32, generator=gen).to(dtype).requires_grad_()
    weight = (1 + 0.1 * torch.randn(32, generator=gen)).to(dtype).requires_grad_()
    grad = torch.randn(3, 5, 32, generator=gen).to(dtype)
    x_ref, w_ref = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    want = _hf_rms_norm(x_ref, w_ref, 1e-6)
    want.backward(grad)
    got = LeanRMSNormFn.apply(x, weight, 1e-6, FUSED)
    got.backward(grad)
    assert fused == ["_norm_forward", "_norm_backward"]  # both ran compiled
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(x.grad, x_ref.grad, **tol)
    torch.testing.assert_close(weight.grad, w_ref.grad, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_swiglu_matches_autograd(fused, dtype):  # noqa: F811
    tol = {} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}
    plain = _hf_mlp().to(dtype)
    lean = copy.deepcopy(plain)
    assert enable_lean_mlp(_holder(lean), options=FUSED) == 1
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 16, generator=gen).to(dtype)
    grad = torch.randn(2, 7, 16, generator=gen).to(dtype)
    x_ref, x_got = x.clone().requires_grad_(), x.clone().requires_grad_()
    plain(x_ref).backward(grad)
    out = lean(x_got)
    out.backward(grad)
    torch.testing.assert_close(out, plain(x_ref.detach()), **tol)
    torch.testing.assert_close(x_got.grad, x_ref.grad, **tol)
    for (name, p), (_, q) in zip(plain.named_parameters(), lean.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name, **tol)
    assert "_swiglu" in fused and "_swiglu_backward" in fused


def test_fused_tiny_qwen3_step_matches_plain(fused):  # noqa: F811
    model = _tiny_model()
    want = _lm_step(model, _batch())
    lean = copy.deepcopy(model)
    enable_lean_rmsnorm(lean, options=FUSED)
    enable_lean_mlp(lean, options=FUSED)
    loss, grads = _lm_step(lean, _batch())
    assert {"_norm_forward", "_norm_backward", "_swiglu", "_swiglu_backward"} <= set(fused)
    torch.testing.assert_close(loss, want[0], rtol=1e-5, atol=1e-5)
    for name, g in want[1].items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5, msg=name)


def test_fused_elementwise_needs_lean_activations():
    from laden.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="actor.fused_elementwise=true needs actor.lean_activations=true"):
        config_from_dict({"actor": {"lean_activations": False, "fused_elementwise": True}})
    # The default (null) follows the machine, so it never conflicts with lean_activations=false.
    cfg = config_from_dict({"actor": {"lean_activations": False}})
    assert cfg.actor.fused_elementwise is None


@pytest.mark.parametrize(
    ("setting", "lean", "cuda", "want"),
    [(None, True, False, False), (None, True, True, True), (None, False, True, False),
     (True, True, False, True), (False, True, True, False)],
)  # fmt: skip
def test_the_default_is_on_with_a_gpu_and_off_on_the_cpu(monkeypatch, setting, lean, cuda, want):
    from laden.config import config_from_dict
    from laden.model.patches.apply import resolve_fused_elementwise

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    cfg = config_from_dict({"actor": {"lean_activations": lean, "fused_elementwise": setting}})
    assert resolve_fused_elementwise(cfg.actor.fused_elementwise, cfg.actor.lean_activations) is want


def test_a_function_that_does_not_compile_runs_eager_with_one_warning(monkeypatch):
    """A compiler failure (here a stand-in dynamo error) warns once and runs the function eager from
    then on; an error of the computation itself is raised as usual."""
    from torch._dynamo.exc import TorchDynamoException

    attempts: list[str] = []

    def failing_compile(fn, static_last_dims):
        def run(*args):
            attempts.append(fn.__name__)
            if fn.__name__ == "bad_input":
                raise ValueError("a real error")
            raise TorchDynamoException("no backend here")

        return run

    monkeypatch.setattr(fused_module, "_compiled", failing_compile)
    monkeypatch.setattr(fused_module, "_EAGER", set())

    def double(x):
        return 2 * x

    x = torch.arange(3.0)
    with pytest.warns(UserWarning, match="double did not compile .*TorchDynamoException: no backend here"):
        torch.testing.assert_close(fused_module.call(double, x, options=FUSED), 2 * x)
    torch.testing.assert_close(
        fused_module.call(double, x, options=FUSED), 2 * x
    )  # eager now: no new attempt
    assert attempts == ["double"]

    def bad_input(x):
        return x

    with pytest.raises(ValueError, match="a real error"):
        fused_module.call(bad_input, x, options=FUSED)


def test_tensor_subclasses_run_eager(monkeypatch):
    """A tensor subclass (tensor parallelism's DTensor) never reaches the compiler; plain tensors and
    parameters do."""
    compiled: list[str] = []
    monkeypatch.setattr(
        fused_module, "_compiled", lambda fn, static: lambda *args: compiled.append(fn.__name__) or fn(*args)
    )

    class Marked(torch.Tensor):
        pass

    def double(x):
        return 2 * x

    x = torch.arange(3.0)
    fused_module.call(double, x.as_subclass(Marked), options=FUSED)
    assert compiled == []
    fused_module.call(double, x, options=FUSED)
    fused_module.call(double, torch.nn.Parameter(x), options=FUSED)
    assert compiled == ["double", "double"]
    fused_module.call(double, x, options=EAGER)  # fused kernels off: never compiled
    assert compiled == ["double", "double"]


@pytest.mark.parametrize("static", [True, False], ids=["static_last_dims", "dynamic_last_dims"])
def test_strided_halves_compile_once_for_every_token_count(monkeypatch, static):
    """Joint gate/up projections, with static last dimensions (`PatchOptions.static_last_dims`,
    the default) and without: the compiled SwiGLU reads strided halves of one buffer and writes
    both gradients side by side, matches autograd, and a second token count reuses the compiled
    code (no new graph)."""
    from patch_cases import _stack_gate_up

    counters = torch._dynamo.utils.counters
    options = PatchOptions(fused=True, static_last_dims=static, joint_projections=True)
    called: list[str] = []
    real_call = fused_module.call
    monkeypatch.setattr(
        fused_module,
        "call",
        lambda fn, *args, options: called.append(fn.__name__) or real_call(fn, *args, options=options),
    )
    plain = _hf_mlp()
    lean = copy.deepcopy(plain)
    assert enable_lean_mlp(_holder(lean), options=options) == 1
    _stack_gate_up(lean)
    gen = torch.Generator().manual_seed(4)
    graphs = []
    for tokens in (7, 11):
        x = torch.randn(2, tokens, 16, generator=gen)
        grad = torch.randn(2, tokens, 16, generator=gen)
        x_ref, x_got = x.clone().requires_grad_(), x.clone().requires_grad_()
        plain(x_ref).backward(grad)
        out = lean(x_got)
        out.backward(grad)
        torch.testing.assert_close(out, plain(x_ref.detach()))
        torch.testing.assert_close(x_got.grad, x_ref.grad)
        for (name, p), (_, q) in zip(plain.named_parameters(), lean.named_parameters()):
            torch.testing.assert_close(q.grad, p.grad, msg=name)
        plain.zero_grad()
        lean.zero_grad()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0]  # the second token count compiled nothing new
    assert called.count("_swiglu_backward_stacked") == 2  # the joint path, once per backward


def test_two_models_in_one_process_keep_their_own_kernels(monkeypatch):
    """A fused model and an eager one, patched alike but for their options, trained in turn in one
    process: every step of the fused one compiles its norms, SwiGLU and rotary (run eagerly here),
    no step of the eager one does, and both match the plain model's loss and gradients."""
    from laden.model.patches.fused_rotary import RotaryFn, enable_fused_rotary, rotary_options

    compiled: list[str] = []
    monkeypatch.setattr(fused_module, "_compiled", lambda fn, static: compiled.append(fn.__name__) or fn)
    rotations: list[int] = []
    apply = RotaryFn.apply
    monkeypatch.setattr(RotaryFn, "apply", lambda *args: rotations.append(1) or apply(*args))
    plain = _tiny_model()
    want = _lm_step(plain, _batch())
    models = {}
    for name, options in (("fused", FUSED), ("eager", EAGER)):
        model = models[name] = copy.deepcopy(plain)
        enable_lean_rmsnorm(model, options=options)
        enable_lean_mlp(model, options=options)
        enable_fused_rotary(model, options=options)
        assert rotary_options(model.model.layers[0].self_attn) == options
    num_layers = plain.config.num_hidden_layers
    for name in ("fused", "eager", "fused", "eager"):
        compiled.clear()
        rotations.clear()
        _assert_model_same(_lm_step(models[name], _batch()), want)
        if name == "fused":
            assert {"_norm_forward", "_norm_backward", "_swiglu", "_swiglu_backward", "_rope"} <= set(
                compiled
            )
            assert len(rotations) == num_layers
        else:
            assert compiled == [] and rotations == []


def test_static_and_dynamic_last_dims_are_per_model(monkeypatch):
    """Two lean norms of one width in one process, one compiled with static last dimensions and one
    with dynamic shapes, called in turn at two token counts: each gets its own graph (the static
    one with the width as a constant, the dynamic one with a symbol, although the static graph's
    guards would take the dynamic model's inputs) and the second token count compiles nothing."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    widths: list[object] = []  # the input's last dimension in each compiled graph: an int or a SymInt

    def record(gm, example_inputs):
        for node in gm.graph.nodes:
            value = node.meta.get("example_value") if node.op == "placeholder" else None
            if isinstance(value, torch.Tensor) and value.dim() == 3:
                widths.append(value.shape[-1])
        return gm.forward

    def compile_recorded(fn, static):
        return torch.compile(fused_module._variant(fn, static), backend=record, dynamic=True, fullgraph=True)

    monkeypatch.setattr(fused_module, "_compiled", functools.cache(compile_recorded))
    plain = Qwen3RMSNorm(32, eps=1e-6)
    static, dynamic = copy.deepcopy(plain), copy.deepcopy(plain)
    enable_lean_rmsnorm(static, options=PatchOptions(fused=True))
    enable_lean_rmsnorm(dynamic, options=PatchOptions(fused=True, static_last_dims=False))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for tokens in (5, 9):
            for norm in (static, dynamic):
                x = torch.randn(2, tokens, 32, generator=gen)
                torch.testing.assert_close(norm(x), plain(x))
    assert len(widths) == 2, widths
    assert type(widths[0]) is int and widths[0] == 32
    assert isinstance(widths[1], torch.SymInt)
