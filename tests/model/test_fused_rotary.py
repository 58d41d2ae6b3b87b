"""Fused rotary embedding == Hugging Face's `apply_rotary_pos_emb` (outputs and gradients), and the
attention re-classing that puts it in place: bitwise the original with fused kernels off, equal to
float rounding with them on (inductor's CPU backend here); the options are per model (its class)."""

from __future__ import annotations

import copy
import functools
import pickle

import pytest
import torch
from patch_cases import FUSED, _llama, _qwen3, fused  # noqa: F401  (the fixture)

from laden.model.patches import fused_rotary
from laden.model.patches.fused_rotary import (
    RotaryFn,
    disable_fused_rotary,
    enable_fused_rotary,
    is_fused_rotary,
    rotary_options,
)
from laden.model.patches.options import EAGER


def _hf_rotation(q, k, cos, sin, unsqueeze_dim=1):
    """Plain PyTorch: q cos + rotate_half(q) sin, rotate_half(x) = cat(-x2, x1)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@pytest.mark.parametrize(
    ("dtype", "tol"),
    [(torch.float32, {}), (torch.bfloat16, {"rtol": 2e-2, "atol": 2e-2})],
    ids=["fp32", "bf16"],
)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_rotary_fn_matches_autograd(fused, dtype, tol, unsqueeze_dim):  # noqa: F811
    gen = torch.Generator().manual_seed(0)
    heads_first = unsqueeze_dim == 1  # [B, H, T, D] (HF's attention) or [B, T, H, D]
    q_shape, k_shape = ((2, 4, 7, 16), (2, 2, 7, 16)) if heads_first else ((2, 7, 4, 16), (2, 7, 2, 16))
    q = torch.randn(q_shape, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(k_shape, generator=gen).to(dtype).requires_grad_()
    cos, sin = (torch.randn(2, 7, 16, generator=gen).to(dtype) for _ in range(2))
    grads = (torch.randn(q_shape, generator=gen).to(dtype), torch.randn(k_shape, generator=gen).to(dtype))
    q_ref, k_ref = (t.detach().clone().requires_grad_() for t in (q, k))
    want = _hf_rotation(q_ref, k_ref, cos, sin, unsqueeze_dim)
    torch.autograd.backward(want, grads)
    got = RotaryFn.apply(q, k, cos, sin, unsqueeze_dim, FUSED)
    torch.autograd.backward(got, grads)
    for g, w in zip((*got, q.grad, k.grad), (*want, q_ref.grad, k_ref.grad)):
        torch.testing.assert_close(g, w, **tol)
    assert fused == ["_rope", "_rope_backward"]  # both ran compiled


def _step(model, ids):
    model.zero_grad()
    logits = model(input_ids=ids).logits
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_attention_with_fused_rotary_equals_hugging_face(arch, monkeypatch):
    """Re-classed attention: bitwise the original with fused kernels off; with them on, RotaryFn runs
    once per layer and the step (logits and every gradient) agrees to fp32 rounding. Enabling again
    with other options re-classes the modules to those options' class."""
    build = {"qwen3": _qwen3, "llama": lambda: _llama(tied=False)}[arch]
    ref, model = build(), build()
    ids = torch.randint(4, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    want = _step(ref, ids)
    layers = model.model.layers
    assert enable_fused_rotary(model, options=EAGER) == len(layers)
    assert enable_fused_rotary(model, options=EAGER) == len(layers)  # again: nothing changes
    assert all(is_fused_rotary(layer.self_attn) for layer in layers)
    assert rotary_options(layers[0].self_attn) == EAGER
    assert type(layers[0].self_attn).__name__ == f"FusedRope{type(ref.model.layers[0].self_attn).__name__}"
    assert model.state_dict().keys() == ref.state_dict().keys()
    off = _step(model, ids)
    torch.testing.assert_close(off[0], want[0], rtol=0, atol=0)
    for name, grad in want[1].items():
        torch.testing.assert_close(off[1][name], grad, rtol=0, atol=0, msg=name)

    calls: list[int] = []
    apply = RotaryFn.apply
    monkeypatch.setattr(RotaryFn, "apply", lambda *args: calls.append(1) or apply(*args))
    eager_class = type(layers[0].self_attn)
    assert enable_fused_rotary(model, options=FUSED) == len(layers)  # the options change, nothing else
    assert rotary_options(layers[0].self_attn) == FUSED and type(layers[0].self_attn) is not eager_class
    assert type(layers[0].self_attn).__mro__[1] is type(ref.model.layers[0].self_attn)
    on = _step(model, ids)
    assert len(calls) == len(layers)
    torch.testing.assert_close(on[0], want[0])
    for name, grad in want[1].items():
        torch.testing.assert_close(on[1][name], grad, msg=name)

    copied, restored = copy.deepcopy(model), pickle.loads(pickle.dumps(model))
    assert all(rotary_options(m.model.layers[0].self_attn) == FUSED for m in (copied, restored))
    assert disable_fused_rotary(model) == len(layers)
    assert type(layers[0].self_attn) is type(ref.model.layers[0].self_attn)


def _deprecating(func):
    """A `functools.wraps` decorator that holds the wrapped function in its closure (transformers'
    `deprecate_kwarg` does the same)."""

    @functools.wraps(func)
    def wrapped(*args, **kwargs):
        if "old" in kwargs:
            kwargs["new"] = kwargs.pop("old")
        return func(*args, **kwargs)

    return wrapped


def test_rebinding_keeps_a_wrapping_decorator():
    def forward(q, k, cos, sin, new=None):
        return apply_rotary_pos_emb(q, k, cos, sin), new  # noqa: F821  (bound by the rebinding)

    decorated = _deprecating(forward)
    seen = []
    rebound = fused_rotary._rebound(decorated, lambda *args: seen.append(len(args)) or "rotated")
    assert rebound(1, 2, 3, 4, old="kept") == ("rotated", "kept")  # the decorator still renames
    assert seen == [4]
    assert rebound.__wrapped__ is not forward and rebound.__name__ == "forward"
    with pytest.raises(NameError):  # the original is untouched
        decorated(1, 2, 3, 4)


class _OwnRotation(torch.nn.Module):
    """An attention module whose rotation is not the module-level standard one."""

    def forward(self, q):
        return q


def test_other_attention_modules_are_left_alone_with_a_warning():
    model = _qwen3()
    layer = model.model.layers[0]
    layer.self_attn = _OwnRotation()
    with pytest.warns(UserWarning, match="_OwnRotation as is"):
        assert enable_fused_rotary(model, options=FUSED) == len(model.model.layers) - 1
    assert not is_fused_rotary(layer.self_attn)


def test_a_nonstandard_rotation_is_not_taken_for_the_standard_one():
    assert fused_rotary._standard_rotation(_hf_rotation)
    assert not fused_rotary._standard_rotation(lambda q, k, cos, sin: (q * cos, k * cos))
    assert not fused_rotary._standard_rotation(lambda q, k: (q, k))


@pytest.mark.gpu
def test_rotary_fn_on_cuda_matches_autograd(fused):  # noqa: F811
    """The compiled (triton) rotation in bf16 on CUDA, Qwen3-1.7B head shapes: outputs and input
    gradients at least as close to the fp32 rotation as eager bf16 autograd's (which rounds each
    product to bf16 before the sum; the fused kernel rounds once), and within bf16 tolerance."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 16, 512, 128, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    k = torch.randn(1, 8, 512, 128, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    cos, sin = (torch.randn(1, 512, 128, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    grads = tuple(torch.randn_like(t) for t in (q, k))
    q_ref, k_ref = (t.detach().clone().requires_grad_() for t in (q, k))
    q32, k32 = (t.detach().float().requires_grad_() for t in (q, k))
    want = _hf_rotation(q_ref, k_ref, cos, sin)
    torch.autograd.backward(want, grads)
    exact = _hf_rotation(q32, k32, cos.float(), sin.float())
    torch.autograd.backward(exact, [g.float() for g in grads])
    got = RotaryFn.apply(q, k, cos, sin, 1, FUSED)
    torch.autograd.backward(got, grads)
    triples = zip((*got, q.grad, k.grad), (*want, q_ref.grad, k_ref.grad), (*exact, q32.grad, k32.grad))
    for g, w, e in triples:
        assert (g.float() - e).abs().max() <= (w.float() - e).abs().max()
        torch.testing.assert_close(g.float(), e, rtol=2e-2, atol=2e-2)
