"""RoundPipe-compatible names and run options, each against a plain PyTorch reference.

CPU fp32, tiny models built here, fixed seeds. The CPU is the device: the same scheduling
code as on GPUs runs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _CustomReducer, _Replicate

import laden
from laden import (
    GradScaler,
    ModelExecutePlan,
    OptimizerCtx,
    RoundPipe,
    RoundPipeRunConfig,
    doing_recompute,
    get_recompute_data,
    save_for_recompute,
)
from laden.engine.roundpipe.microbatch_spec import PackedOutputs
from laden.optim import Adam

pytestmark = pytest.mark.usefixtures("one_thread")

SPLIT = ModelExecutePlan(fwd_plan=[range(0, 2)], bwd_plan=[range(2, 4), range(0, 2)])


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Linear(12, 3))


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def mse_sum(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum()


# ---- GradScaler ---------------------------------------------------------------------------
def test_grad_scaler_sync_equals_torch_amp_grad_scaler():
    """Synchronous steps: weights and scale follow torch.amp.GradScaler exactly, overflow included."""
    ref = mlp()
    rp = RoundPipe(mlp(), optim_dtype=torch.float32)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-3)
    opt = torch.optim.SGD(rp.optim_parameters(), lr=1e-3)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    scaler = GradScaler(init_scale=1024.0, growth_interval=2)
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=SPLIT)
    for it in range(5):
        x, y = batch(it)
        poison = float("inf") if it == 2 else 1.0  # one overflowing step: skipped, scale backs off
        ref_scaler.scale(mse_sum(ref(x), y) * poison).backward()
        ref_scaler.step(ref_opt)
        ref_opt.zero_grad()
        ref_scaler.update()
        rp.forward_backward(
            input_args=(x,),
            label=y,
            loss_fn=lambda o, t, poison=poison: scaler.scale(mse_sum(o, t) * poison),
            run_config=cfg,
        )
        rp.step(lambda: (scaler.step(opt), opt.zero_grad()), is_async=False)
        scaler.update(is_async=False)
        assert scaler.get_scale() == ref_scaler.get_scale()
    rp.synchronize()
    for p_ref, p in zip(ref.parameters(), rp.model.parameters()):
        torch.testing.assert_close(p, p_ref)
    assert scaler.get_scale() == 2048.0  # grown, backed off at the overflow, grown again


def test_grad_scaler_async_backs_off_one_update_late():
    """Asynchronous steps: the overflowing step is skipped; the loss scale reacts at the next update."""
    rp = RoundPipe(mlp(), optim_dtype=torch.float32)
    opt = torch.optim.SGD(rp.optim_parameters(), lr=1e-3)
    scaler = GradScaler(init_scale=256.0, growth_interval=100)
    seen = []
    for it in range(3):
        x, y = batch(it)
        poison = float("nan") if it == 0 else 1.0
        seen.append(scaler.get_scale())
        rp.forward_backward(
            input_args=(x,), label=y, loss_fn=lambda o, t, poison=poison: scaler.scale(mse_sum(o, t) * poison)
        )
        rp.step(lambda: (scaler.step(opt), opt.zero_grad()))
        scaler.update()
    rp.synchronize()
    assert seen == [256.0, 256.0, 128.0]
    assert all(torch.isfinite(p).all() for p in rp.model.parameters())
    with pytest.raises(RuntimeError, match="inside step_fn"):
        scaler.unscale_(opt)


def test_grad_scaler_disabled_is_plain_step():
    scaler = GradScaler(enabled=False)
    t = torch.ones(2)
    assert scaler.scale(t) is t and scaler.get_scale() == 1.0


# ---- OptimizerCtx, optim_named_parameters -------------------------------------------------
def test_optimizer_ctx_parameters_are_the_masters():
    rp = RoundPipe(mlp(), optim_dtype=torch.float32)
    with OptimizerCtx():
        masters = list(rp.parameters())
        named = dict(rp.named_parameters())
    assert [id(p) for p in masters] == [id(p) for p in rp.optim_parameters()]
    assert named.keys() == dict(rp.optim_named_parameters()).keys()
    assert len(list(rp.parameters())) == len(masters)  # outside: the model's own parameters


def test_optim_named_parameters_remove_duplicate():
    torch.manual_seed(0)
    emb, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied
    rp = RoundPipe(nn.Sequential(emb, head), optim_dtype=torch.float32)
    unique = dict(rp.optim_named_parameters())
    every = dict(rp.optim_named_parameters(prefix="m", remove_duplicate=False))
    assert list(unique) == ["0.weight"]
    assert list(every) == ["m.0.weight", "m.1.weight"] and every["m.0.weight"] is every["m.1.weight"]


# ---- forward_backward(return_outputs=True), merge and output options -------------------------
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_return_outputs_equals_model_outputs(grain):
    ref, rp = mlp(), RoundPipe(mlp())
    x, y = batch()
    cfg = RoundPipeRunConfig(num_microbatch=4, recompute_grain=grain, execute_plan=SPLIT)
    loss, out = rp.forward_backward(
        input_args=(x,), label=y, loss_fn=mse_sum, return_outputs=True, run_config=cfg
    )
    expected = ref(x)
    torch.testing.assert_close(out, expected.detach())
    torch.testing.assert_close(loss, mse_sum(expected, y).detach())
    assert not out.requires_grad


def test_scalar_outputs_are_averaged_and_merge_options():
    class Stats(nn.Module):
        def forward(self, x):
            return {"h": x * 2, "mean": x.mean(), "tag": "same"}

    rp = RoundPipe(nn.Sequential(nn.Identity(), Stats()))
    x = torch.arange(8.0).reshape(4, 2)
    out = rp(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=4))
    torch.testing.assert_close(out["h"], x * 2)
    torch.testing.assert_close(out["mean"], x.mean(dim=1).mean())  # mean of the micro-batch means
    summed = rp(x, roundpipe_run_config=RoundPipeRunConfig(
        num_microbatch=4, merge_output={"h": TensorChunkSpec(0), "mean": _CustomReducer(0.0, lambda a, b: a + b),
                                        "tag": _Replicate},
    ))  # fmt: skip
    torch.testing.assert_close(summed["mean"], x.mean(dim=1).sum())
    custom = rp(
        x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=2, merge_output=lambda outs: len(outs))
    )
    assert custom == 2
    packed = rp(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=2, merge_output=False))
    assert isinstance(packed["h"], PackedOutputs) and len(packed["h"]) == 2
    torch.testing.assert_close(torch.cat(packed["h"]), x * 2)


def test_unmerged_outputs_chain_into_the_next_model():
    first, second = mlp(0), mlp(1)
    second[0] = nn.Linear(3, 12)
    ref_in, _ = batch()
    a, b = RoundPipe(copy.deepcopy(first)), RoundPipe(copy.deepcopy(second))
    with torch.no_grad():
        mid = a(ref_in, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=4, merge_output=False))
        out = b(mid, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=4))
    torch.testing.assert_close(out, second(first(ref_in)).detach())


def test_run_config_positional_form_and_output_device():
    cfg = RoundPipeRunConfig(False, "cpu", True, "layer", 3)
    assert (cfg.requires_grad, cfg.output_device, cfg.preserve_rng_state, cfg.recompute_grain) == (
        False, "cpu", True, "layer",
    )  # fmt: skip
    assert cfg.num_microbatch == 3
    rp = RoundPipe(mlp())
    x, y = batch()
    loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum, run_config=cfg)
    assert loss.device == torch.device("cpu")
    with pytest.raises(ValueError, match="split_input"):
        RoundPipeRunConfig(split_input=[TensorChunkSpec(0)])


def test_split_specs_equal_the_whole_batch():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 3)

        def forward(self, x, bias):  # x: [6, B] (batch on dim 1), bias: [3] replicated
            return self.lin(x.T) + bias

    torch.manual_seed(0)
    ref = TwoInputs()
    rp = RoundPipe(nn.Sequential(copy.deepcopy(ref)))
    x, y = batch()
    x_t, bias = x.T.contiguous(), torch.randn(3)
    cfg = RoundPipeRunConfig(
        num_microbatch=4, split_input=((TensorChunkSpec(1), _Replicate), None), split_label=TensorChunkSpec(0)
    )
    loss = rp.forward_backward(input_args=(x_t, bias), label=y, loss_fn=mse_sum, run_config=cfg)
    ref_loss = mse_sum(ref(x_t, bias), y)
    ref_loss.backward()
    rp.synchronize()
    torch.testing.assert_close(loss, ref_loss.detach())
    for p_ref, p in zip(ref.parameters(), rp.model.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad)


# ---- recompute data -----------------------------------------------------------------------
class MaskedLayer(nn.Module):
    """Keeps its data-dependent mask for the recompute instead of computing it again."""

    def __init__(self, calls: list[str]):
        super().__init__()
        self.lin = nn.Linear(12, 12)
        self.calls = calls

    def forward(self, x):
        if doing_recompute():
            (mask,) = get_recompute_data()
            self.calls.append("recompute")
        else:
            mask = (x > 0).detach()
            save_for_recompute(mask)
            self.calls.append("forward")
        return self.lin(x) * mask


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_recompute_reads_the_saved_data(grain):
    calls: list[str] = []
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), MaskedLayer(calls), nn.Tanh(), nn.Linear(12, 3))
    ref = copy.deepcopy(model)
    rp = RoundPipe(model)
    x, y = batch()
    cfg = RoundPipeRunConfig(num_microbatch=2, recompute_grain=grain, execute_plan=SPLIT)
    loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum, run_config=cfg)
    ref_loss = mse_sum(ref(x), y)
    ref_loss.backward()
    rp.synchronize()
    torch.testing.assert_close(loss, ref_loss.detach())
    for p_ref, p in zip(ref.parameters(), rp.model.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad)
    assert (
        calls.count("recompute") == 2 and calls.count("forward") == 2
    )  # the reference holds a copy of the list
    with pytest.raises(AssertionError, match="doing_recompute"):
        get_recompute_data()


# ---- Adam ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"weight_decay": 0.1}, {"weight_decay": 0.1, "decoupled_weight_decay": True}, {"amsgrad": True}],
)
def test_adam_equals_torch_adam(kwargs):
    ref, rp = mlp(), RoundPipe(mlp(), optim_dtype=torch.float32)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, betas=(0.8, 0.99), **kwargs)
    opt = laden.optim.Adam(rp.optim_parameters(), lr=1e-2, betas=(0.8, 0.99), **kwargs)
    for it in range(3):
        x, y = batch(it)
        mse_sum(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum)
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    rp.synchronize()
    for p_ref, p in zip(ref.parameters(), rp.model.parameters()):
        torch.testing.assert_close(p, p_ref)


def test_adam_refuses_what_it_cannot_do():
    p = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="capturable"):
        Adam([p], capturable=True)
    with pytest.raises(ValueError, match="fp32"):
        Adam([nn.Parameter(torch.zeros(3, dtype=torch.float16))])
    with pytest.warns(UserWarning, match="fused"):
        Adam([p], fused=True)


# ---- attribute forwarding -----------------------------------------------------------------
def test_attribute_writes_reach_the_wrapped_model():
    inner = mlp()
    rp = RoundPipe(inner)
    rp.vocab_size = 11
    assert inner.vocab_size == 11 and rp.vocab_size == 11
    del rp.vocab_size
    assert not hasattr(inner, "vocab_size")
    rp.name = "renamed"  # the wrapper's own attribute stays on the wrapper
    assert rp.name == "renamed" and not hasattr(inner, "name")
    original = nn.Module()
    original.config = "cfg"
    rp.set_original_model(original)
    assert rp.config == "cfg"
    rp.flag = True
    assert original.flag is True and not hasattr(inner, "flag")


def test_grad_scaler_update_without_a_step_sets_or_refuses():
    from laden import GradScaler

    scaler = GradScaler(init_scale=1024.0)
    with pytest.raises(RuntimeError, match="no model.step since the last update"):
        scaler.update(is_async=False)
    scaler.update(new_scale=torch.tensor(16.0), is_async=False)
    assert scaler.get_scale() == 16.0
