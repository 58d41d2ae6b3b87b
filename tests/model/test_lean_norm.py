"""Lean RMSNorm == Hugging Face's RMSNorm: outputs, input and weight gradients, whole models, memory."""

from __future__ import annotations

import copy
import importlib
import pickle

import pytest
import torch
from lean_cases import _layer_saved_bytes, _tiny_model, check_enable_disable_round_trip
from tiled_cases import _assert_model_same, _batch, _lm_step
from torch import nn

from laden.model.attention import set_attention
from laden.model.patches.lean_norm import LeanRMSNormFn, disable_lean_rmsnorm, enable_lean_rmsnorm
from laden.model.patches.options import EAGER, PatchOptions, options_of
from laden.model.patches.tiled import enable_tiled_mlp

EPS = 1e-6


def _hf_norm_class(family: str, name: str) -> type[nn.Module]:
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls = getattr(module, name, None)
    if cls is None:
        pytest.skip(f"{name} is not in the installed transformers")
    return cls


FAMILIES = [
    ("qwen3", "Qwen3RMSNorm"),
    ("qwen2", "Qwen2RMSNorm"),
    ("llama", "LlamaRMSNorm"),
    ("mistral", "MistralRMSNorm"),
]


def _norm(cls: type[nn.Module], width: int, dtype=torch.float32, seed=0) -> nn.Module:
    norm = cls(width, eps=EPS).to(dtype)
    with torch.no_grad():  # a non-trivial weight: the default ones() would hide weight bugs
        norm.weight.copy_(1 + 0.5 * torch.randn(width, generator=torch.Generator().manual_seed(seed)))
    return norm


def _lean_copy(norm: nn.Module, options: PatchOptions = EAGER) -> nn.Module:
    lean = copy.deepcopy(norm)
    assert enable_lean_rmsnorm(lean, options=options) == 1
    assert type(lean).__name__ == f"Lean{type(norm).__name__}" and isinstance(lean, type(norm))
    return lean


def _run(norm, x, grad_out, *, autocast=False):
    """Output, input gradient and weight gradient for a non-unit upstream gradient."""
    norm.zero_grad()
    x = x.detach().requires_grad_(x.requires_grad)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = norm(x)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), x.grad, norm.weight.grad


def _assert_same(got, want, **tol):
    for name, g, w in zip(("output", "input grad", "weight grad"), got, want):
        if w is None:
            assert g is None, name
        else:
            assert g.dtype == w.dtype, name
            torch.testing.assert_close(g, w, msg=lambda m, n=name: f"{n}: {m}", **tol)


def _inputs(shape, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(shape, generator=gen) + 0.5).to(dtype).requires_grad_()
    return x, torch.randn(shape, generator=gen).to(dtype)


SHAPES = {"BTH": (2, 9, 48), "per_head": (2, 9, 4, 32)}  # per_head: like q_norm over [B, T, heads, head_dim]
TOLERANCES = {torch.float32: {"rtol": 1e-6, "atol": 1e-6}, torch.bfloat16: {}}  # bf16: one rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("family,name", FAMILIES, ids=[n for _, n in FAMILIES])
def test_matches_hf_module(family, name, shape, dtype):
    norm = _norm(_hf_norm_class(family, name), shape[-1], dtype)
    x, grad_out = _inputs(shape, dtype)
    want = _run(norm, x, grad_out)
    got = _run(_lean_copy(norm), x, grad_out)
    assert got[0].dtype == dtype
    _assert_same(got, want, **TOLERANCES[dtype])


@pytest.mark.parametrize(
    "x_dtype,weight_dtype,autocast",
    [
        (torch.bfloat16, torch.float32, False),  # mixed: the output promotes to fp32, as in HF
        (torch.float32, torch.bfloat16, False),
        (torch.float32, torch.float32, True),  # a fp32 model under bf16 autocast
        (torch.bfloat16, torch.float32, True),  # q_norm of a bf16 projection in a fp32 model
    ],
)
def test_mixed_dtypes_and_autocast_match_hf(x_dtype, weight_dtype, autocast):
    norm = _norm(_hf_norm_class("qwen3", "Qwen3RMSNorm"), 32, weight_dtype)
    x, grad_out = _inputs((3, 7, 32), x_dtype, seed=2)
    want = _run(norm, x, grad_out, autocast=autocast)
    got = _run(_lean_copy(norm), x, grad_out, autocast=autocast)
    low = torch.bfloat16 if torch.bfloat16 in (x_dtype, weight_dtype) else torch.float32
    _assert_same(got, want, **TOLERANCES[low])


def test_backward_inside_autocast_matches_hf():
    """A backward called inside the autocast region computes in the same dtypes."""
    norm = _norm(_hf_norm_class("qwen3", "Qwen3RMSNorm"), 32, torch.float32)
    lean = _lean_copy(norm)
    x, grad_out = _inputs((5, 32), torch.bfloat16, seed=3)
    results = []
    for module in (norm, lean):
        xx = x.detach().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(xx)
            out.backward(grad_out.float())
        results.append((out.detach(), xx.grad, module.weight.grad))
    _assert_same(results[1], results[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_frozen_weight_and_input_without_grad(dtype):
    norm = _norm(_hf_norm_class("qwen3", "Qwen3RMSNorm"), 48, dtype)
    lean = _lean_copy(norm)
    x, grad_out = _inputs((2, 9, 48), dtype, seed=4)
    # LoRA-like: the norm frozen, the input trainable.
    norm.weight.requires_grad_(False)
    lean.weight.requires_grad_(False)
    got = _run(lean, x, grad_out)
    assert got[2] is None and got[1] is not None
    _assert_same(got, _run(norm, x, grad_out), **TOLERANCES[dtype])
    # The weight alone: an input that needs no gradient (e.g. from a frozen embedding).
    norm.weight.requires_grad_(True)
    lean.weight.requires_grad_(True)
    got = _run(lean, x.detach(), grad_out)
    assert got[1] is None and got[2] is not None
    _assert_same(got, _run(norm, x.detach(), grad_out), **TOLERANCES[dtype])


def test_function_against_plain_formula():
    """LeanRMSNormFn.apply against the formula written out here, and under no_grad (no graph)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 6, 16, generator=gen, dtype=torch.float64).requires_grad_()
    weight = torch.randn(16, generator=gen, dtype=torch.float64).requires_grad_()
    grad_out = torch.randn(4, 6, 16, generator=gen, dtype=torch.float64)

    def plain(x, weight):  # fp64 in, so every cast of the HF recipe is a no-op or exact
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + EPS)).double()

    got = torch.autograd.grad(LeanRMSNormFn.apply(x, weight, EPS, EAGER), (x, weight), grad_out)
    want = torch.autograd.grad(plain(x, weight), (x, weight), grad_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    with torch.no_grad():
        out = LeanRMSNormFn.apply(x, weight, EPS, EAGER)
    assert out.grad_fn is None
    torch.testing.assert_close(out, plain(x, weight))


def _saved(fn):
    """[(shape, dtype)] of every tensor autograd saves while running fn()."""
    saved: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


def test_saves_only_input_weight_and_rstd():
    norm = _norm(_hf_norm_class("qwen3", "Qwen3RMSNorm"), 32, torch.bfloat16)
    x, _ = _inputs((2, 9, 4, 32), torch.bfloat16)
    assert sorted(_saved(lambda: _lean_copy(norm)(x)), key=str) == sorted(
        [((2, 9, 4, 32), torch.bfloat16), ((32,), torch.bfloat16), ((2, 9, 4, 1), torch.float32)], key=str
    )
    # Hugging Face's graph keeps the fp32 copy of x (twice) and the normalised value besides.
    assert ((2, 9, 4, 32), torch.float32) in _saved(lambda: norm(x))


# --- whole models ------------------------------------------------------------------------------


def test_tiny_qwen3_lean_equals_plain():
    model = _tiny_model()
    want = _lm_step(model, _batch())
    lean = copy.deepcopy(model)
    num_layers = model.config.num_hidden_layers
    assert enable_lean_rmsnorm(lean) == 4 * num_layers + 1  # input, post-attention, q, k; final norm
    assert lean.state_dict().keys() == model.state_dict().keys()
    assert type(lean.model.layers[0].self_attn.q_norm).__name__ == "LeanQwen3RMSNorm"
    _assert_model_same(_lm_step(lean, _batch()), want)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
def test_lean_with_gradient_checkpointing_and_tiled_mlp():
    model = _tiny_model()
    want = _lm_step(model, _batch(seed=1))
    enable_lean_rmsnorm(model)
    enable_tiled_mlp(model, tile_tokens=7)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    _assert_model_same(_lm_step(model, _batch(seed=1)), want)


def test_disable_and_reenable_keep_state_dict():
    def norms(model):
        return [m for m in model.modules() if "RMSNorm" in type(m).__name__]

    check_enable_disable_round_trip(enable_lean_rmsnorm, disable_lean_rmsnorm, 9, norms, "Qwen3RMSNorm")


def test_copies_and_pickles_stay_lean_on_their_own_weight():
    """A shallow copy with its own parameter dict (how roundpipe binds device weights), a deep copy
    and a pickle round trip all run lean, each on its own weight, with the model's options."""
    plain = _norm(_hf_norm_class("qwen3", "Qwen3RMSNorm"), 32)
    options = PatchOptions(static_last_dims=False, joint_projections=True)  # not the defaults
    lean = _lean_copy(plain, options)
    shell = copy.copy(lean)
    shell._parameters = {"weight": nn.Parameter(lean.weight.detach() * 2)}
    x, grad_out = _inputs((3, 32), torch.float32, seed=6)
    for module, scale in ((shell, 2.0), (copy.deepcopy(lean), 1.0), (pickle.loads(pickle.dumps(lean)), 1.0)):
        assert type(module) is type(lean) and options_of(module) == options
        want_norm = copy.deepcopy(plain)
        with torch.no_grad():
            want_norm.weight.mul_(scale)
        got = _run(module, x, grad_out)
        _assert_same(got, _run(want_norm, x, grad_out))
        assert _saved(lambda m=module: m(x.detach().requires_grad_()))[0] == ((3, 32), torch.float32)
    assert lean.weight.grad is None  # the shell's backward went to the shell's own weight


def test_other_semantics_are_left_alone():
    gemma = _hf_norm_class("gemma", "GemmaRMSNorm")(16)  # x * (1 + weight), computed in fp32
    olmo2 = _hf_norm_class("olmo2", "Olmo2RMSNorm")(16)  # (weight * x).to(dtype): cast after the weight

    class ScaledRMSNorm(_hf_norm_class("qwen3", "Qwen3RMSNorm")):  # same attributes, other forward
        def forward(self, hidden_states):
            return 2 * super().forward(hidden_states)

    model = nn.ModuleDict({"gemma": gemma, "olmo2": olmo2, "scaled": ScaledRMSNorm(16)})
    with pytest.warns(UserWarning, match="GemmaRMSNorm.*Olmo2RMSNorm.*ScaledRMSNorm"):
        assert enable_lean_rmsnorm(model) == 0
    assert [type(m).__name__ for m in model.values()] == ["GemmaRMSNorm", "Olmo2RMSNorm", "ScaledRMSNorm"]


def test_instance_level_forward_is_refused():
    model = _tiny_model()
    norm = model.model.layers[1].input_layernorm
    norm.forward = norm.forward  # as accelerate's device_map hooks do
    with pytest.raises(ValueError, match=r"model\.layers\.1\.input_layernorm has its forward replaced"):
        enable_lean_rmsnorm(model)
    assert not any(type(m).__name__.startswith("Lean") for m in model.modules())  # nothing switched


# --- memory ------------------------------------------------------------------------------------


def test_decoder_layer_saves_less_by_the_fp32_copies():
    """bf16 layer: each norm of width W over R rows saved an fp32 copy of x (4W) and the bf16
    normalised value (2W) per row; lean saves x (2W): 4W bytes per row fewer."""
    num_tokens, heads, kv_heads, head_dim, hidden = 512, 4, 2, 64, 256
    model = _tiny_model(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=768,
        num_hidden_layers=1,
    ).to(torch.bfloat16)
    assert model.config.head_dim == head_dim
    set_attention(model, "auto")
    plain_bytes, _ = _layer_saved_bytes(model, num_tokens)
    enable_lean_rmsnorm(model)
    lean_bytes, lean_saved = _layer_saved_bytes(model, num_tokens)

    norm_widths = [hidden, hidden, heads * head_dim, kv_heads * head_dim]  # input, post-attn, q, k
    expected_saving = sum(4 * num_tokens * width for width in norm_widths)
    assert lean_bytes < plain_bytes
    assert plain_bytes - lean_bytes >= expected_saving, (plain_bytes, lean_bytes, expected_saving)
    # What fp32 is left is per-row statistics (reciprocal RMS, attention log-sum-exp), no copy of x.
    assert all(t.numel() <= num_tokens * heads for t in lean_saved if t.dtype == torch.float32)
