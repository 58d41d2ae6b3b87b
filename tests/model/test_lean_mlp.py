"""Lean gated MLP == Hugging Face's MLP: outputs, input and weight gradients, whole models, memory."""

from __future__ import annotations

import copy
import importlib
import pickle

import pytest
import torch
import torch.nn.functional as F
from lean_cases import (
    HIDDEN,
    INTER,
    _hf_mlp,
    _hf_mlp_class,
    _holder,
    _lean_copy,
    _tiny_model,
    check_enable_disable_round_trip,
)
from tiled_cases import GatedMLP, _assert_model_same, _batch, _lm_step, _other_arch
from torch import nn

from laden.model.patches.lean_mlp import LeanGatedMLPFn, disable_lean_mlp, enable_lean_mlp, is_lean_mlp
from laden.model.patches.options import EAGER, PatchOptions, options_of
from laden.model.patches.tiled import disable_tiled_mlp, enable_tiled_mlp, tile_tokens_of

FAMILIES = [("qwen3", "Qwen3MLP"), ("qwen2", "Qwen2MLP"), ("llama", "LlamaMLP"), ("mistral", "MistralMLP")]


def _run(mlp, x, grad_out, *, autocast=False):
    """Output, input gradient and parameter gradients for a non-unit upstream gradient."""
    mlp.zero_grad()
    leaf = x.detach().requires_grad_(x.requires_grad)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = mlp(leaf * 1 if leaf.requires_grad else leaf)  # not a leaf, as in a model: autocast casts it
    out.backward(grad_out.to(out.dtype))
    grads = {n: p.grad for n, p in mlp.named_parameters() if p.grad is not None}
    return out.detach(), leaf.grad, grads


def _assert_same(got, want, **tol):
    for name, g, w in zip(("output", "input grad"), got[:2], want[:2]):
        if w is None:
            assert g is None, name
        else:
            assert g.dtype == w.dtype, name
            torch.testing.assert_close(g, w, msg=lambda m, n=name: f"{n}: {m}", **tol)
    assert got[2].keys() == want[2].keys()
    for name, w in want[2].items():
        assert got[2][name].dtype == w.dtype, name
        torch.testing.assert_close(got[2][name], w, msg=lambda m, n=name: f"{n}: {m}", **tol)


def _inputs(shape, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).requires_grad_(), torch.randn(shape, generator=gen)


BF16 = {"rtol": 1.6e-2, "atol": 1e-5}
SHAPES = {"TH": (11, HIDDEN), "BTH": (2, 7, HIDDEN)}


# --- the autograd Function against a plain PyTorch reference -----------------------------------


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize(
    "act", [F.silu, lambda t: F.gelu(t, approximate="tanh"), torch.relu], ids=["silu", "gelu", "relu"]
)
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_function_matches_plain_formula(shape, act, bias):
    gen = torch.Generator().manual_seed(2)
    params = [
        torch.randn(INTER, HIDDEN, generator=gen),
        torch.randn(INTER, generator=gen) if bias else None,
        torch.randn(INTER, HIDDEN, generator=gen),
        torch.randn(INTER, generator=gen) if bias else None,
        torch.randn(HIDDEN, INTER, generator=gen),
        torch.randn(HIDDEN, generator=gen) if bias else None,
    ]
    params = [None if p is None else p.requires_grad_() for p in params]
    wg, bg, wu, bu, wd, bd = params
    x, grad_out = _inputs(shape, seed=3)
    inputs = [x] + [p for p in params if p is not None]

    def plain():
        gate = x @ wg.t() + (0 if bg is None else bg)
        up = x @ wu.t() + (0 if bu is None else bu)
        return (act(gate) * up) @ wd.t() + (0 if bd is None else bd)

    lean_out = LeanGatedMLPFn.apply(x, act, *params, EAGER)
    got = torch.autograd.grad(lean_out, inputs, grad_out)
    want_out = plain()
    want = torch.autograd.grad(want_out, inputs, grad_out)
    torch.testing.assert_close(lean_out, want_out)
    for name, g, w in zip(["x", "w_gate", "b_gate", "w_up", "b_up", "w_down", "b_down"], got, want):
        torch.testing.assert_close(g, w, msg=lambda m, n=name: f"{n}: {m}")
    with torch.no_grad():
        out = LeanGatedMLPFn.apply(x, act, *params, EAGER)
    assert out.grad_fn is None
    torch.testing.assert_close(out, want_out.detach())


# --- Hugging Face's modules ----------------------------------------------------------------------


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("family,name", FAMILIES, ids=[n for _, n in FAMILIES])
def test_matches_hf_module_fp32(family, name, shape):
    mlp = _hf_mlp(family, name)
    x, grad_out = _inputs(shape)
    got, want = _run(_lean_copy(mlp), x, grad_out), _run(mlp, x, grad_out)
    assert torch.equal(got[0], want[0])  # the same ops: bitwise the same output
    _assert_same(got, want)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_bias_and_other_activations_match_hf(act):
    """Llama with mlp_bias=True: the bias gradients are the rows' sums."""
    mlp = _hf_mlp("llama", "LlamaMLP", mlp_bias=True, hidden_act=act)
    assert mlp.gate_proj.bias is not None
    x, grad_out = _inputs((2, 7, HIDDEN), seed=4)
    got, want = _run(_lean_copy(mlp), x, grad_out), _run(mlp, x, grad_out)
    assert {"gate_proj.bias", "up_proj.bias", "down_proj.bias"} <= got[2].keys()
    assert torch.equal(got[0], want[0])
    _assert_same(got, want)


@pytest.mark.parametrize(
    "param_dtype,autocast",
    [
        (torch.float32, True),  # fp32 masters under bf16 autocast (laden's mixed precision)
        (torch.bfloat16, False),  # a bf16 model
        (torch.bfloat16, True),
    ],
)
def test_bf16_and_autocast_match_hf(param_dtype, autocast):
    mlp = _hf_mlp().to(param_dtype)
    x, grad_out = _inputs((3, 9, HIDDEN), param_dtype, seed=5)
    got = _run(_lean_copy(mlp), x, grad_out, autocast=autocast)
    want = _run(mlp, x, grad_out, autocast=autocast)
    assert got[0].dtype == torch.bfloat16 and torch.equal(got[0], want[0])
    assert all(g.dtype == param_dtype for g in got[2].values())  # weight grads in the parameter dtype
    _assert_same(got, want, **BF16)


def test_backward_inside_autocast_matches_hf():
    """A backward called inside the autocast region computes in the same dtypes."""
    mlp = _hf_mlp()
    lean = _lean_copy(mlp)
    x, grad_out = _inputs((5, HIDDEN), seed=6)
    results = []
    for module in (mlp, lean):
        leaf = x.detach().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(leaf * 1)
            out.backward(grad_out.bfloat16())
        results.append((out.detach(), leaf.grad, {n: p.grad for n, p in module.named_parameters()}))
    _assert_same(results[1], results[0], **BF16)


def test_frozen_weights_and_input_without_grad():
    """LoRA-like: the base weights frozen get no gradient; and an input that needs none."""
    mlp = _hf_mlp(seed=7)
    lean = _lean_copy(mlp)
    for module in (mlp, lean):
        module.gate_proj.weight.requires_grad_(False)
        module.down_proj.weight.requires_grad_(False)
    x, grad_out = _inputs((2, 7, HIDDEN), seed=7)
    got = _run(lean, x, grad_out)
    assert set(got[2]) == {"up_proj.weight"} and got[1] is not None
    _assert_same(got, _run(mlp, x, grad_out))
    got = _run(lean, x.detach(), grad_out)  # only up_proj's weight needs a gradient
    assert got[1] is None and set(got[2]) == {"up_proj.weight"}
    _assert_same(got, _run(mlp, x.detach(), grad_out))
    for module in (mlp, lean):  # all frozen but down_proj: nothing flows into gate and up
        module.up_proj.weight.requires_grad_(False)
        module.down_proj.weight.requires_grad_(True)
    got = _run(lean, x.detach(), grad_out)
    assert set(got[2]) == {"down_proj.weight"}
    _assert_same(got, _run(mlp, x.detach(), grad_out))


def test_no_grad_forward_matches():
    mlp = _hf_mlp()
    x, _ = _inputs((2, 7, HIDDEN))
    with torch.no_grad():
        out = _lean_copy(mlp)(x)
        assert out.grad_fn is None and torch.equal(out, mlp(x))


# --- memory --------------------------------------------------------------------------------------


def _saved_row_values(fn, rows: int) -> dict[torch.dtype, int]:
    """Values per row of the distinct per-row tensors autograd saves while fn() runs, by dtype."""
    storages: dict[int, tuple[torch.dtype, int]] = {}

    def pack(t):
        if t.dim() >= 2 and t.shape[:-1].numel() == rows:  # activations, not (cast) weights
            storages[t.untyped_storage().data_ptr()] = (t.dtype, t.shape[-1])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    values: dict[torch.dtype, int] = {}
    for dtype, width in storages.values():
        values[dtype] = values.get(dtype, 0) + width
    return values


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast_bf16"])
def test_saves_input_gate_and_up_only(autocast):
    """H + 4I values per token -> H + 2I (under autocast Hugging Face keeps x cast twice: 2H + 4I)."""
    mlp = _hf_mlp()
    lean = _lean_copy(mlp)
    x, _ = _inputs((2, 7, HIDDEN))
    dtype = torch.bfloat16 if autocast else torch.float32

    def run(module):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return _saved_row_values(lambda: module(x * 1), rows=14)

    assert run(mlp) == {dtype: (2 if autocast else 1) * HIDDEN + 4 * INTER}
    assert run(lean) == {dtype: HIDDEN + 2 * INTER}


def test_decoder_layer_saves_2i_fewer_bytes_per_token():
    """bf16 decoder layer (as tests/model/test_lean_norm.py measures it): 2 * I * 2 bytes per token fewer."""
    from lean_cases import _layer_saved_bytes

    from laden.model.attention import set_attention

    num_tokens, inter = 256, 384
    model = _tiny_model(hidden_size=128, intermediate_size=inter, num_hidden_layers=1).to(torch.bfloat16)
    set_attention(model, "auto")
    plain_bytes, _ = _layer_saved_bytes(model, num_tokens)
    assert enable_lean_mlp(model) == 1
    lean_bytes, _ = _layer_saved_bytes(model, num_tokens)
    assert plain_bytes - lean_bytes == num_tokens * 2 * inter * 2


# --- whole models --------------------------------------------------------------------------------


def _train(model, steps=3, lr=0.1):
    """Losses and gradients of a few SGD steps (the weights move, so later steps see other values)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    history = []
    for step in range(steps):
        history.append(_lm_step(model, _batch(seed=step)))
        opt.step()
    return history


def test_tiny_qwen3_lean_trains_like_plain():
    model = _tiny_model()
    lean = copy.deepcopy(model)
    assert enable_lean_mlp(lean) == model.config.num_hidden_layers
    assert lean.state_dict().keys() == model.state_dict().keys()
    assert all(type(layer.mlp).__name__ == "LeanQwen3MLP" for layer in lean.model.layers)
    for got, want in zip(_train(lean), _train(model)):
        _assert_model_same(got, want)


def test_tied_weights_stay_tied():
    model = _tiny_model()
    model.model.layers[1].mlp.up_proj.weight = model.model.layers[0].mlp.up_proj.weight
    want = _lm_step(model, _batch(seed=5))
    lean = copy.deepcopy(model)
    enable_lean_mlp(lean)
    assert lean.model.layers[1].mlp.up_proj.weight is lean.model.layers[0].mlp.up_proj.weight
    _assert_model_same(_lm_step(lean, _batch(seed=5)), want)


@pytest.mark.parametrize("arch", ["Qwen2", "Llama", "Mistral"])
def test_other_architectures_lean_equal_plain(arch):
    model = _other_arch(arch)
    want = _lm_step(model, _batch(seed=4))
    lean = copy.deepcopy(model)
    assert enable_lean_mlp(lean) == 3
    _assert_model_same(_lm_step(lean, _batch(seed=4)), want)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_lean_with_gradient_checkpointing(use_reentrant):
    model = _tiny_model()
    want = _lm_step(model, _batch(seed=1))
    enable_lean_mlp(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model.train()
    _assert_model_same(_lm_step(model, _batch(seed=1)), want)


@pytest.mark.parametrize("lean_first", [True, False], ids=["lean_then_tiled", "tiled_then_lean"])
def test_composes_with_tiled_mlp_in_either_order(lean_first, monkeypatch):
    model = _tiny_model()
    want = _lm_step(model, _batch(seed=3))
    num_layers = model.config.num_hidden_layers
    if lean_first:
        assert enable_lean_mlp(model) == num_layers
    assert enable_tiled_mlp(model, tile_tokens=7) == num_layers
    if not lean_first:
        assert enable_lean_mlp(model) == num_layers
    assert enable_lean_mlp(model) == num_layers  # already lean (and tiled): nothing changes
    mlp = model.model.layers[0].mlp
    assert type(mlp).__name__ == "TiledLeanQwen3MLP" and type(mlp).__mro__[1].__name__ == "LeanQwen3MLP"
    assert is_lean_mlp(mlp) and tile_tokens_of(mlp) == 7
    _assert_model_same(_lm_step(model, _batch(seed=3)), want)
    # The tiles run lean, in forward and in backward's recompute; the tiled MLP keeps x alone.
    calls: list[int] = []
    apply = LeanGatedMLPFn.apply
    monkeypatch.setattr(
        LeanGatedMLPFn, "apply", lambda x, *args: calls.append(x.shape[-2]) or apply(x, *args)
    )
    x = torch.randn(1, 20, 64, requires_grad=True)
    assert _saved_row_values(lambda: mlp(x * 1).sum().backward(), rows=20) == {torch.float32: 64}
    assert calls == [7, 7, 6] * 2
    monkeypatch.undo()
    copied = copy.deepcopy(model)  # a tiled lean MLP deep-copies (pickle is not supported)
    assert type(copied.model.layers[0].mlp) is type(mlp)
    # Either undo leaves the other in place.
    if lean_first:
        assert disable_lean_mlp(model) == num_layers
        assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["TiledQwen3MLP"] * 2
        assert tile_tokens_of(model.model.layers[0].mlp) == 7
    else:
        assert disable_tiled_mlp(model) == num_layers
        assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["LeanQwen3MLP"] * 2
    _assert_model_same(_lm_step(model, _batch(seed=3)), want)


def test_disable_and_reenable_keep_state_dict():
    def mlps(model):
        return [layer.mlp for layer in model.model.layers]

    check_enable_disable_round_trip(enable_lean_mlp, disable_lean_mlp, 2, mlps, "Qwen3MLP")
    assert not is_lean_mlp(_tiny_model().model.layers[0].mlp)


def test_copies_and_pickles_stay_lean_on_their_own_weights():
    """A shallow copy with its own parameter dicts (how roundpipe binds device weights), a deep copy
    and a pickle round trip all run lean, each on its own weights, with the model's options."""
    plain = _hf_mlp(seed=8)
    options = PatchOptions(static_last_dims=False, joint_projections=True)  # not the defaults
    lean = _lean_copy(plain, options)
    shell = copy.copy(lean)
    shell._modules = {name: copy.copy(sub) for name, sub in lean._modules.items()}
    for sub in shell._modules.values():
        sub._parameters = {
            k: None if v is None else nn.Parameter(v.detach() * 2) for k, v in sub._parameters.items()
        }
    x, grad_out = _inputs((3, 5, HIDDEN), seed=8)
    for module, scale in ((shell, 2.0), (copy.deepcopy(lean), 1.0), (pickle.loads(pickle.dumps(lean)), 1.0)):
        assert type(module) is type(lean) and options_of(module) == options
        want_mlp = copy.deepcopy(plain)
        with torch.no_grad():
            for p in want_mlp.parameters():
                p.mul_(scale)
        _assert_same(_run(module, x, grad_out), _run(want_mlp, x, grad_out))
        assert _saved_row_values(lambda m=module: m(x * 1), rows=15) == {torch.float32: HIDDEN + 2 * INTER}
    assert all(p.grad is None for p in lean.parameters())  # the copies' backward went to their own weights


def test_other_mlps_are_left_alone_with_a_warning():
    class ScaledMLP(_hf_mlp_class("qwen3", "Qwen3MLP")):  # same attributes, other forward
        def forward(self, x):
            return 2 * super().forward(x)

    hooked = _hf_mlp()
    hooked.up_proj.register_forward_hook(lambda m, args, out: out * 0)  # the lean forward would bypass it
    lora_like = _hf_mlp()
    lora_like.down_proj = nn.Sequential(nn.Linear(INTER, HIDDEN))  # not a plain nn.Linear
    from transformers import LlamaConfig, Phi3Config

    scaled = ScaledMLP(LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=4))
    mlps = [_hf_mlp(), GatedMLP(HIDDEN, INTER), scaled, hooked, lora_like]  # GatedMLP: same math, other code
    model = _holder(*mlps)
    with pytest.warns(UserWarning, match="GatedMLP, Qwen3MLP, test_other_mlps.*ScaledMLP as is"):
        assert enable_lean_mlp(model) == 1
    assert [type(layer.mlp).__name__ for layer in model.layers] == [
        "LeanQwen3MLP", "GatedMLP", "ScaledMLP", "Qwen3MLP", "Qwen3MLP"
    ]  # fmt: skip
    phi3 = importlib.import_module("transformers.models.phi3.modeling_phi3")  # fused gate_up_proj
    fused = phi3.Phi3MLP(Phi3Config(hidden_size=HIDDEN, intermediate_size=INTER))
    with pytest.warns(UserWarning, match="Phi3MLP"):
        assert enable_lean_mlp(_holder(fused)) == 0


def test_instance_level_forward_and_unknown_models_are_refused():
    model = _tiny_model()
    mlp = model.model.layers[1].mlp
    mlp.forward = mlp.forward  # as accelerate's device_map hooks do
    with pytest.raises(ValueError, match=r"Qwen3ForCausalLM: layers\.1\.mlp has its forward replaced"):
        enable_lean_mlp(model)
    assert not any(type(m).__name__.startswith("Lean") for m in model.modules())  # nothing switched
    with pytest.raises(ValueError, match=r"no decoder layers at `model\.model\.layers`.*enable_lean_mlp"):
        enable_lean_mlp(nn.Linear(4, 4))


@pytest.mark.parametrize("tiled", [False, True])
def test_a_projection_changed_after_enabling_runs_the_original_forward(tiled):
    """A hook (or an adapter) added to a projection after the MLP was made lean is not bypassed."""
    model = _tiny_model()
    enable_lean_mlp(model)
    if tiled:
        enable_tiled_mlp(model, tile_tokens=2)
    mlp = model.model.layers[0].mlp
    calls = []
    mlp.up_proj.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    x = torch.randn(1, 5, mlp.gate_proj.in_features)
    y = mlp(x)
    assert calls  # the hook ran: the original forward called the projection (once per tile when tiled)
    torch.testing.assert_close(y, mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)))
