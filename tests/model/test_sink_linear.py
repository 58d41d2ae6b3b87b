"""Attention projections whose weight gradients go to a GradSink == nn.Linear with autograd's gradients."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from patch_cases import RecordingSink
from tiny import tiny_qwen3_config
from torch import nn
from transformers import AutoModelForCausalLM

from laden.model.patches.grad_sink import attach_sink, suspended
from laden.model.patches.options import EAGER, PatchOptions
from laden.model.patches.sink_linear import (
    _HANDED,
    JOINT,
    _JointLinearFn,
    disable_sink_linears,
    enable_sink_linears,
    is_sink_linear,
)

pytestmark = pytest.mark.usefixtures("one_thread")

JOINT_ON = PatchOptions(joint_projections=True)  # per model; off by default


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


def _stack_qkv(model: nn.Module) -> None:
    """Each attention's query, key and value weights become rows of one flat buffer, as the
    roundpipe engine uploads a layer (its parameters back to back, in the module's order)."""
    for layer in model.model.layers:
        attn = layer.self_attn
        weights = [getattr(attn, name).weight for name in JOINT]
        flat = torch.cat([w.detach().reshape(-1) for w in weights])
        offset = 0
        for name, w in zip(JOINT, weights):
            getattr(attn, name).weight = nn.Parameter(flat[offset : offset + w.numel()].view(w.shape))
            offset += w.numel()


def _count_joint(monkeypatch) -> list[int]:
    calls: list[int] = []
    forward = _JointLinearFn.forward

    def spy(ctx, x, stacked, sinks, *weights):
        calls.append(len(weights))
        return forward(ctx, x, stacked, sinks, *weights)

    monkeypatch.setattr(_JointLinearFn, "forward", staticmethod(spy))
    return calls


def test_stacked_query_key_value_run_as_one_gemm_and_train_as_three_projections(monkeypatch):
    """fp32: a Qwen3 whose q/k/v weights lie back to back gives the plain model's loss and every
    gradient (to float rounding: one GEMM instead of three, the input gradient summed inside
    them), through one joint projection per layer; without a graph the same outputs."""
    calls = _count_joint(monkeypatch)
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(tiny_qwen3_config(vocab_size=32, num_hidden_layers=2))
    joint = copy.deepcopy(plain)
    enable_sink_linears(joint, options=JOINT_ON)
    _stack_qkv(joint)
    ids = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(1))
    want = plain(input_ids=ids, labels=ids).loss
    want.backward()
    got = joint(input_ids=ids, labels=ids).loss
    got.backward()
    assert calls == [3, 3]  # one joint projection per layer
    torch.testing.assert_close(got, want)
    grads = dict(joint.named_parameters())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(
            grads[name].grad, p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
    with torch.no_grad():
        torch.testing.assert_close(joint(input_ids=ids).logits, plain(input_ids=ids).logits)
    assert calls == [3, 3]  # no graph: one plain GEMM, no autograd function
    assert all(_HANDED not in m.__dict__ for m in joint.modules())  # nothing left handed out


def test_stacked_projections_give_their_sinks_the_weight_gradients(monkeypatch):
    """bf16 weights with sinks: each sink receives its own weight's gradient factors (the exact
    fp32 sum of autograd's bf16 weight gradients), `.grad` stays empty, and the input gradient is
    autograd's to bf16 rounding (summed inside the GEMMs instead of after them)."""
    calls = _count_joint(monkeypatch)
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(tiny_qwen3_config(vocab_size=32, num_hidden_layers=1))
    plain = plain.to(torch.bfloat16)
    joint = copy.deepcopy(plain)
    enable_sink_linears(joint, options=JOINT_ON)
    _stack_qkv(joint)
    attn = joint.model.layers[0].self_attn
    sinks = {name: RecordingSink(getattr(attn, name).weight) for name in JOINT}
    for name, sink in sinks.items():
        attach_sink(getattr(attn, name).weight, sink)
    x = torch.randn(2, 6, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2))
    grad_out = torch.randn(2, 6, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    outs = {}
    for model in (plain, joint):
        xi = x.clone().requires_grad_()
        layer = model.model.layers[0]
        pos = torch.arange(6).expand(2, 6)
        out = layer(xi, position_embeddings=model.model.rotary_emb(xi, pos), attention_mask=None)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad_out)
        outs[model is joint] = (out, xi.grad)
    assert calls == [3]
    torch.testing.assert_close(outs[True][0], outs[False][0], rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(outs[True][1], outs[False][1], rtol=1.6e-2, atol=1e-2)
    plain_attn = plain.model.layers[0].self_attn
    for name, sink in sinks.items():
        assert getattr(attn, name).weight.grad is None and sink.calls == 1
        want = getattr(plain_attn, name).weight.grad.float()
        torch.testing.assert_close(sink.acc, want, rtol=1.6e-2, atol=1e-2, msg=lambda m, n=name: f"{n}: {m}")


def test_joint_projections_are_off_by_default(monkeypatch):
    """Off (the default): no hooks, and stacked weights still run as three projections."""
    calls = _count_joint(monkeypatch)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(vocab_size=32, num_hidden_layers=2))
    enable_sink_linears(model)
    _stack_qkv(model)
    assert not model.model.layers[0].self_attn._forward_pre_hooks
    ids = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    assert calls == []


def test_joint_projection_hooks_pickle_and_go_with_disable():
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(vocab_size=32, num_hidden_layers=2))
    enable_sink_linears(model, options=JOINT_ON)
    enable_sink_linears(model, options=JOINT_ON)  # again: one pair of hooks per attention
    attn = model.model.layers[0].self_attn
    assert len(attn._forward_pre_hooks) == 1 and len(attn._forward_hooks) == 1
    clone = pickle.loads(pickle.dumps(model))
    assert len(clone.model.layers[1].self_attn._forward_pre_hooks) == 1
    assert disable_sink_linears(model) == 8
    assert not attn._forward_pre_hooks and not attn._forward_hooks and not attn._forward_hooks_always_called


def test_two_models_keep_their_own_joint_projections(monkeypatch):
    """One model with joint projections and one without, both with stacked q/k/v weights, trained in
    turn in one process: only the first runs them as one GEMM, both give the plain model's loss;
    enabling again with the option off takes the hooks away."""
    calls = _count_joint(monkeypatch)
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(tiny_qwen3_config(vocab_size=32, num_hidden_layers=2))
    ids = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(1))
    want = plain(input_ids=ids, labels=ids).loss
    models = {}
    for options in (JOINT_ON, EAGER):
        model = models[options] = copy.deepcopy(plain)
        enable_sink_linears(model, options=options)
        _stack_qkv(model)
    for options in (JOINT_ON, EAGER, JOINT_ON, EAGER):
        calls.clear()
        torch.testing.assert_close(models[options](input_ids=ids, labels=ids).loss, want)
        assert calls == ([3, 3] if options.joint_projections else [])
    enable_sink_linears(models[JOINT_ON], options=EAGER)
    assert not models[JOINT_ON].model.layers[0].self_attn._forward_pre_hooks
