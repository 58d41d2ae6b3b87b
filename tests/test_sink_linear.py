"""Attention projections whose weight gradients go to a GradSink == nn.Linear with autograd's gradients."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from test_grad_sink import RecordingSink
from torch import nn
from transformers import AutoModelForCausalLM

from laden.model.grad_sink import attach_sink, suspended
from laden.model.sink_linear import disable_sink_linears, enable_sink_linears, is_sink_linear
from laden.model.tiny import tiny_qwen3_config

pytestmark = pytest.mark.usefixtures("one_thread")


def _swapped(linear: nn.Linear) -> nn.Linear:
    holder = nn.Module()
    holder.model = nn.Module()
    holder.model.layers = nn.ModuleList([nn.Module()])
    attn = holder.model.layers[0].self_attn = nn.Module()
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        setattr(attn, name, copy.deepcopy(linear))
    assert enable_sink_linears(holder) == 4
    return attn.q_proj


@pytest.mark.parametrize("bias", [False, True])
def test_sink_projection_equals_autograd_linear(bias):
    """bf16 weights: the input (and bias) gradients are autograd's bit for bit, the sink holds the
    exact fp32 sum of autograd's bf16 weight gradients over three micro-batches, `.grad` stays empty."""
    torch.manual_seed(0)
    plain = nn.Linear(16, 24, bias=bias).to(torch.bfloat16)
    sunk = _swapped(plain)
    sink = RecordingSink(sunk.weight)
    attach_sink(sunk.weight, sink)
    want_w = torch.zeros(24, 16)
    want_b, got_b = torch.zeros(24), torch.zeros(24)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(2, 5, 16, generator=gen).to(torch.bfloat16)
        g = torch.randn(2, 5, 24, generator=gen).to(torch.bfloat16)
        xp, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
        plain.zero_grad()
        out_p, out_s = plain(xp), sunk(xs)
        torch.testing.assert_close(out_s, out_p, rtol=0, atol=0)
        out_p.backward(g)
        out_s.backward(g)
        torch.testing.assert_close(xs.grad, xp.grad, rtol=0, atol=0)
        want_w += plain.weight.grad
        assert sunk.weight.grad is None
        if bias:
            want_b += plain.bias.grad
            got_b += sunk.bias.grad
            sunk.bias.grad = None
    assert sink.calls == 3
    torch.testing.assert_close(sink.acc, want_w, rtol=0, atol=0)
    torch.testing.assert_close(got_b, want_b, rtol=0, atol=0)


def test_without_a_sink_a_projection_is_nn_linear():
    """No sink, a suspended sink, no graph or a mixed-dtype input: the weight's `.grad` as usual."""
    torch.manual_seed(0)
    sunk = _swapped(nn.Linear(8, 8))
    x = torch.randn(3, 8, requires_grad=True)
    sunk(x).sum().backward()
    assert sunk.weight.grad is not None
    sink = RecordingSink(sunk.weight)
    attach_sink(sunk.weight, sink)
    sunk.weight.grad = None
    with suspended():
        sunk(x).sum().backward()
    assert sunk.weight.grad is not None and sink.calls == 0
    with torch.no_grad():
        assert not sunk(x).requires_grad
    sunk.weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the plain path: its casts are autocast's
        sunk(x).float().sum().backward()
    assert sunk.weight.grad is not None and sink.calls == 0


def test_enable_on_a_causal_lm_counts_reclasses_and_pickles():
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(vocab_size=32, num_hidden_layers=2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert enable_sink_linears(model) == 8
    assert enable_sink_linears(model) == 8  # again: nothing changes
    assert all(is_sink_linear(getattr(model.model.layers[0].self_attn, n)) for n in ("q_proj", "o_proj"))
    assert not is_sink_linear(model.lm_head)
    assert model.state_dict().keys() == before.keys()
    clone = pickle.loads(pickle.dumps(model))
    assert is_sink_linear(clone.model.layers[1].self_attn.v_proj)
    assert disable_sink_linears(model) == 8
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear


def test_attention_with_a_hooked_projection_is_left_alone():
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(vocab_size=32, num_hidden_layers=2))
    model.model.layers[1].self_attn.k_proj.register_forward_hook(lambda *a: None)
    with pytest.warns(UserWarning, match="enable_sink_linears left the attention"):
        assert enable_sink_linears(model) == 4
    assert not is_sink_linear(model.model.layers[1].self_attn.q_proj)
