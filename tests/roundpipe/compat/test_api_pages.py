"""The RoundPipe API reference pages (`docs/API/*.en.md`), case by case, on laden.

CPU as the device, tiny fp32 models; every case compares with a plain PyTorch reference
written in the test. The first docstring line names the page and the entry.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn

from laden import ModelExecutePlan, RoundPipe, RoundPipeRunConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def mse_sum(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum()


def chunked_loss(model, x, y, num: int, loss_fn=mse_sum):
    return sum(loss_fn(model(xc), yc) for xc, yc in zip(x.chunk(num), y.chunk(num)))


def assert_grads_close(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, p_ref.grad, msg=name)


def assert_params_close(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, p_ref, msg=name)


# ---- context.en.md -----------------------------------------------------------------------------


def test_context_save_for_recompute_example():
    """context.en.md, roundpipe.save_for_recompute: MyLayer saves torch.nonzero(x) and reuses it in the recompute."""
    from laden import doing_recompute, get_recompute_data, save_for_recompute

    phases: list[bool] = []

    class MyLayer(nn.Module):
        def forward(self, x):
            phases.append(doing_recompute())
            if doing_recompute():
                (mask,) = get_recompute_data()
            else:
                mask = torch.nonzero(x)
                save_for_recompute(mask)
            return x, mask

    class UseMask(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 4)

        def forward(self, inputs):
            x, mask = inputs
            return self.proj(x) * mask.shape[0]

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), MyLayer(), UseMask())
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    plan = ModelExecutePlan(fwd_plan=[range(0, 3)], bwd_plan=[range(3, 4), range(0, 3)])
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=1, execute_plan=plan))
    loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum)
    rp.synchronize()
    assert phases == [False, True]
    ref_loss = mse_sum(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_close(model, ref)


def test_context_outside_recompute():
    """context.en.md, doing_recompute / get_recompute_data: False outside a recompute; get_recompute_data raises AssertionError."""
    from laden import doing_recompute, get_recompute_data, save_for_recompute

    assert doing_recompute() is False
    with torch.no_grad():
        save_for_recompute(torch.ones(2))  # a no-op without gradients
    with pytest.raises(AssertionError):
        get_recompute_data()


def test_context_optimizer_ctx_equals_optim_parameters():
    """context.en.md, roundpipe.OptimizerCtx: method 1 (OptimizerCtx) and method 2 (optim_parameters) give the same parameters."""
    from laden import OptimizerCtx

    rp = RoundPipe(mlp())
    with OptimizerCtx():
        inside = [id(p) for p in rp.parameters()]
        named = [n for n, _ in rp.named_parameters()]
    assert inside == [id(p) for p in rp.optim_parameters()]
    assert named == [n for n, _ in rp.optim_named_parameters()]
    assert [id(p) for p in rp.parameters()] == [id(p) for p in rp.model.parameters()]  # outside: model params


# ---- grad_scaler.en.md -------------------------------------------------------------------------


def test_grad_scaler_defaults_and_scale():
    """grad_scaler.en.md, roundpipe.GradScaler / scale / get_*: defaults as torch.amp.GradScaler, scale multiplies."""
    from laden import GradScaler

    scaler = GradScaler()
    assert scaler.get_scale() == 2.0**16
    assert scaler.get_growth_factor() == 2.0 and scaler.get_backoff_factor() == 0.5
    assert scaler.get_growth_interval() == 2000
    loss = torch.tensor(1.5)
    torch.testing.assert_close(scaler.scale(loss), loss * 2.0**16)
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(3)
    assert scaler.get_growth_factor(up_to_date=True) == 4.0
    assert scaler.get_backoff_factor(up_to_date=True) == 0.25
    assert scaler.get_growth_interval(up_to_date=True) == 3
    disabled = GradScaler(enabled=False)
    assert disabled.scale(loss) is loss and disabled.get_scale() == 1.0


def test_grad_scaler_skips_inf_and_backs_off():
    """grad_scaler.en.md, GradScaler.step / update: an inf gradient skips the step and halves the scale, as torch.amp's."""
    from laden import GradScaler

    model, ref = mlp(), mlp()
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    optimizer = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
    scaler = GradScaler(init_scale=4.0, growth_interval=1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    for bad in (True, False):
        target = y.clone()
        if bad:
            target[0, 0] = float("inf")
        rp.forward_backward(input_args=(x,), label=target, loss_fn=lambda o, t: scaler.scale(mse_sum(o, t)))
        rp.step(lambda: (scaler.step(optimizer), optimizer.zero_grad()), is_async=False)
        scaler.update(is_async=False)
        ref_scaler.scale(chunked_loss(ref, x, target, 2)).backward()
        ref_scaler.step(ref_opt)
        ref_opt.zero_grad()
        ref_scaler.update()
        assert scaler.get_scale() == ref_scaler.get_scale()
    assert_params_close(model, ref)


def test_grad_scaler_update_new_scale():
    """grad_scaler.en.md, GradScaler.update(new_scale=...): the value is copied in; later edits of it do not leak."""
    import threading

    from laden import GradScaler

    scaler = GradScaler()
    new_scale = torch.tensor(8.0)
    # a synchronous update with no step submitted must not block forever: bound the wait
    worker = threading.Thread(
        target=scaler.update, kwargs={"new_scale": new_scale, "is_async": False}, daemon=True
    )
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "GradScaler.update(is_async=False) blocked with no optimizer step pending"
    new_scale.fill_(1.0)
    assert scaler.get_scale() == 8.0


# ---- logging.en.md ---------------------------------------------------------------------------


def test_logging_model_timer_verbose(capsys):
    """logging.en.md, ModelTimer.VERBOSE: per-layer "Layer N fwd/re/bwd new record ... new estimate" lines on stderr."""
    from laden.timer import ModelTimer

    assert ModelTimer.VERBOSE is False
    ModelTimer.VERBOSE = True
    try:
        rp = RoundPipe(mlp())
        rp.forward_backward(input_args=(torch.randn(4, 8),), label=torch.randn(4, 4), loss_fn=mse_sum)
        rp.synchronize()
    finally:
        ModelTimer.VERBOSE = False
    err = capsys.readouterr().err
    assert "Layer 0 fwd" in err and "new record" in err and "new estimate" in err


# ---- model.en.md ---------------------------------------------------------------------------------


def test_model_constructor_signature():
    """model.en.md, roundpipe.RoundPipe(model, optim_dtype, name, model_run_config, pin_model): positional order and defaults."""
    params = list(inspect.signature(RoundPipe.__init__).parameters.values())[1:6]
    assert [p.name for p in params] == ["model", "optim_dtype", "name", "model_run_config", "pin_model"]
    assert params[1].default is None and params[2].default is None and params[4].default == "alloc"
    model, ref = mlp(), mlp()
    rp = RoundPipe(model, torch.float32, "my-model", RoundPipeRunConfig(num_microbatch=2), "off")
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(rp(x), ref(x))


def test_model_non_sequential_is_one_layer():
    """model.en.md, RoundPipe `model`: a non-Sequential model is treated as a single layer."""

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x):
            return self.b(x + torch.tanh(self.a(x)))

    torch.manual_seed(0)
    model = Residual()
    ref = copy.deepcopy(model)
    rp = RoundPipe(model)
    assert rp.num_layers == 1
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    loss = rp.forward_backward(
        input_args=(x,), label=y, loss_fn=mse_sum, run_config=RoundPipeRunConfig(num_microbatch=3)
    )
    rp.synchronize()
    ref_loss = chunked_loss(ref, x, y, 3)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_close(model, ref)


def test_model_forward_merges_microbatch_outputs():
    """model.en.md, RoundPipe.forward: split into micro-batches, run, merge; *args and **kwargs reach the model."""

    class Affine(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 4)

        def forward(self, x, *, shift=0.0):
            return self.proj(x) + shift

    torch.manual_seed(0)
    model = nn.Sequential(Affine())
    ref = copy.deepcopy(model)
    x = torch.randn(9, 8)
    rp = RoundPipe(model)
    with torch.no_grad():
        out = rp.forward(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=3), shift=0.5)
        torch.testing.assert_close(out, ref[0](x, shift=0.5))


def test_model_forward_backward_semantics():
    """model.en.md, RoundPipe.forward_backward: the documented per-micro-batch loop (torch.autograd.backward of each loss)."""
    model, ref = mlp(), mlp()
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    rp = RoundPipe(model)
    loss = rp.forward_backward(
        input_args=(x,),
        input_kwargs={},
        label=y,
        loss_fn=mse_sum,
        run_config=RoundPipeRunConfig(num_microbatch=3),
    )
    rp.synchronize()
    losses = []
    for x_mb, y_mb in zip(x.chunk(3), y.chunk(3)):
        loss_mb = mse_sum(ref(x_mb), y_mb)
        torch.autograd.backward(loss_mb)
        losses.append(loss_mb.detach())
    torch.testing.assert_close(loss, sum(losses))
    assert_grads_close(model, ref)


def test_model_forward_backward_sequence_of_losses():
    """model.en.md, RoundPipe.forward_backward: loss_fn may return a sequence of tensors; each is summed over micro-batches."""
    model, ref = mlp(), mlp()
    x, y = torch.randn(6, 8), torch.randn(6, 4)

    def two_losses(out, target):
        return mse_sum(out, target), 0.1 * out.abs().sum()

    rp = RoundPipe(model)
    losses = rp.forward_backward(
        input_args=(x,), label=y, loss_fn=two_losses, run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    rp.synchronize()
    sums = [torch.zeros(()), torch.zeros(())]
    for x_mb, y_mb in zip(x.chunk(2), y.chunk(2)):
        loss_mb = two_losses(ref(x_mb), y_mb)
        torch.autograd.backward(loss_mb)
        sums = [s + loss.detach() for s, loss in zip(sums, loss_mb)]
    assert len(losses) == 2
    for got, expected in zip(losses, sums):
        torch.testing.assert_close(got, expected)
    assert_grads_close(model, ref)


def test_model_forward_backward_default_loss_fn_is_the_output():
    """model.en.md, RoundPipe.forward_backward: the default loss_fn returns the outputs (a model that computes its loss)."""

    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(32, 1)

        def forward(self, h):
            return self.proj(h).pow(2).sum()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), WithLoss())
    ref = copy.deepcopy(model)
    x = torch.randn(6, 8)
    rp = RoundPipe(model)
    loss = rp.forward_backward(input_args=(x,), run_config=RoundPipeRunConfig(num_microbatch=2))
    rp.synchronize()
    ref_loss = sum(ref(c) for c in x.chunk(2))
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_close(model, ref)


def test_model_forward_backward_return_outputs():
    """model.en.md, RoundPipe.forward_backward: return_outputs=True returns (loss_sum, merged_outputs)."""
    model, ref = mlp(), mlp()
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    rp = RoundPipe(model)
    loss, outputs = rp.forward_backward(
        input_args=(x,),
        label=y,
        loss_fn=mse_sum,
        return_outputs=True,
        run_config=RoundPipeRunConfig(num_microbatch=3),
    )
    rp.synchronize()
    ref_loss = chunked_loss(ref, x, y, 3)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    torch.testing.assert_close(outputs, ref(x).detach())
    assert_grads_close(model, ref)


def test_model_optim_parameters_dtype_and_names():
    """model.en.md, RoundPipe.optim_parameters / optim_named_parameters(prefix): optimizer copies in optim_dtype, named like the model."""
    model = mlp()
    rp = RoundPipe(model, optim_dtype=torch.float32)
    named = list(rp.optim_named_parameters(prefix="net"))
    assert [n for n, _ in named] == [f"net.{n}" for n, _ in model.named_parameters()]
    for (_, master), p in zip(named, model.parameters()):
        assert master.dtype == torch.float32
        torch.testing.assert_close(master.detach(), p.detach())
    assert [id(p) for p in rp.optim_parameters()] == [id(p) for _, p in named]


def test_model_optim_named_parameters_remove_duplicate():
    """model.en.md, RoundPipe.optim_named_parameters(remove_duplicate=...): a shared parameter is listed once by default."""
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    model = nn.Sequential(shared, nn.Tanh(), shared)
    rp = RoundPipe(model)
    assert [n for n, _ in rp.optim_named_parameters()] == [n for n, _ in model.named_parameters()]
    every = [n for n, _ in rp.optim_named_parameters(remove_duplicate=False)]
    assert every == [n for n, _ in model.named_parameters(remove_duplicate=False)]


def test_model_step_forwards_args_and_kwargs():
    """model.en.md, RoundPipe.step(step_fn, is_async, *args, **kwargs): extra arguments reach step_fn."""
    model, ref = mlp(), mlp()
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    rp = RoundPipe(model)
    optimizer = torch.optim.SGD(rp.optim_parameters(), lr=1.0)
    calls = []

    def step_fn(lr, *, momentum_free):
        calls.append((lr, momentum_free))
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad()

    rp.forward_backward(
        input_args=(x,), label=y, loss_fn=mse_sum, run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    rp.step(step_fn, False, 0.05, momentum_free=True)
    assert calls == [(0.05, True)]
    chunked_loss(ref, x, y, 2).backward()
    torch.optim.SGD(ref.parameters(), lr=0.05).step()
    assert_params_close(model, ref)


def test_model_synchronize_puts_accumulated_grads_on_params():
    """model.en.md, RoundPipe.synchronize: model params carry the newest weights and the accumulated .grad."""
    model, ref = mlp(), mlp()
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    rp.forward_backward(input_args=(x[:4],), label=y[:4], loss_fn=mse_sum)
    rp.forward_backward(input_args=(x[4:],), label=y[4:], loss_fn=mse_sum)
    rp.synchronize()
    chunked_loss(ref, x, y, 4).backward()
    assert_grads_close(model, ref)


def test_model_wrap_model_to_roundpipe_preset_missing_raises():
    """model.en.md, roundpipe.wrap_model_to_roundpipe: use_sequential_preset=True without a preset raises NotImplementedError."""
    from laden import wrap_model_to_roundpipe

    with pytest.raises(NotImplementedError):
        wrap_model_to_roundpipe(mlp_with_forward(), use_sequential_preset=True)


def mlp_with_forward() -> nn.Module:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = mlp()

        def forward(self, x):
            return self.body(x)

    return Net()


def test_model_wrap_model_to_roundpipe_recursive():
    """model.en.md, wrap_model_to_roundpipe, "Wrapping Strategy Details": a Sequential child is wrapped and trains like the original."""
    from laden import wrap_model_to_roundpipe

    net, ref = mlp_with_forward(), mlp_with_forward()
    ref.load_state_dict(net.state_dict())
    wrapped = wrap_model_to_roundpipe(
        net, use_sequential_preset=False, model_run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), ref(x))


def test_model_set_original_model_proxies_reads():
    """model.en.md, RoundPipe.set_original_model: attribute reads fall back to the original model."""
    original = nn.Linear(8, 4)
    original.vocab_size = 123
    rp = RoundPipe(mlp())
    rp.set_original_model(original)
    assert rp.vocab_size == 123 and rp.in_features == 8


def test_model_attribute_forwarding_read():
    """model.en.md, "Attribute Forwarding" (read): a missing attribute is looked up on the wrapped model."""
    model = mlp()
    model.vocab_size = 64
    rp = RoundPipe(model)
    assert rp.vocab_size == 64
    assert rp.model is model and rp.training is model.training


def test_model_attribute_forwarding_write_and_delete():
    """model.en.md, "Attribute Forwarding" (write, delete): writes and deletions after init go to the wrapped model."""
    model = mlp()
    rp = RoundPipe(model)
    rp.custom_flag = 7
    assert model.custom_flag == 7
    del rp.custom_flag
    assert not hasattr(model, "custom_flag")


# ---- optimizer.en.md --------------------------------------------------------------------------


@pytest.mark.parametrize("amsgrad, maximize", [(False, False), (True, True)])
def test_optimizer_adam_matches_torch(amsgrad, maximize):
    """optimizer.en.md, roundpipe.optim.Adam: a drop-in replacement for torch.optim.Adam on CPU fp32."""
    from laden.optim import Adam

    model, ref = mlp(), mlp()
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    kwargs = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.01, amsgrad=amsgrad, maximize=maximize)
    optimizer = Adam(rp.optim_parameters(), **kwargs)
    ref_opt = torch.optim.Adam(ref.parameters(), **kwargs)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum)
        rp.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
        chunked_loss(ref, x, y, 2).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_params_close(model, ref)


# ---- run_config.en.md ----------------------------------------------------------------------------


def test_run_config_signature():
    """run_config.en.md, roundpipe.RoundPipeRunConfig(...): the nine settings, positional in the documented order."""
    plan = ModelExecutePlan(fwd_plan=[range(0, 5)])
    cfg = RoundPipeRunConfig(False, None, True, "layer", 3, None, None, None, plan)
    assert (cfg.requires_grad, cfg.output_device, cfg.preserve_rng_state) == (False, None, True)
    assert (cfg.recompute_grain, cfg.num_microbatch, cfg.merge_output, cfg.execute_plan) == (
        "layer",
        3,
        None,
        plan,
    )


def test_run_config_defaults_are_none():
    """run_config.en.md, roundpipe.RoundPipeRunConfig: every setting defaults to None (fall back to the model's, then built-in)."""
    cfg = RoundPipeRunConfig()
    for name in (
        "preserve_rng_state",
        "recompute_grain",
        "num_microbatch",
        "split_input",
        "split_label",
        "execute_plan",
    ):
        assert getattr(cfg, name) is None, name


def test_run_config_requires_grad_false_is_inference():
    """run_config.en.md, requires_grad: False runs the forward without a graph even when grad mode is on."""
    rp = RoundPipe(mlp())
    out = rp(torch.randn(4, 8), roundpipe_run_config=RoundPipeRunConfig(requires_grad=False))
    assert not out.requires_grad


def dropout_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.Tanh(), nn.Linear(32, 4))


def test_run_config_preserve_rng_state_replays_dropout():
    """run_config.en.md, preserve_rng_state: the recompute reproduces the forward's dropout masks."""
    model, ref = dropout_model(), dropout_model()
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    plan = ModelExecutePlan(
        fwd_plan=[range(0, 3)], bwd_plan=[range(3, 4), range(0, 3)]
    )  # dropout is recomputed
    rp = RoundPipe(model)
    cfg = RoundPipeRunConfig(num_microbatch=1, execute_plan=plan, preserve_rng_state=True)
    torch.manual_seed(7)
    loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum, run_config=cfg)
    rp.synchronize()
    torch.manual_seed(7)
    ref_loss = mse_sum(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_close(model, ref)


def test_run_config_split_input_custom_function():
    """run_config.en.md, "Writing Custom Split Functions" (split_input): (args, kwargs, n) -> (args_list, kwargs_list)."""
    seen: list[tuple[int, int]] = []

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 4)

        def forward(self, images, masks):
            seen.append((images.shape[0], masks.shape[0]))
            return self.proj(images) * masks

    def custom_split(args, kwargs, num_microbatch):
        images, masks = args
        return list(zip(images.chunk(num_microbatch), masks.chunk(num_microbatch))), [kwargs] * num_microbatch

    torch.manual_seed(0)
    model = nn.Sequential(Pair())
    ref = copy.deepcopy(model)
    images, masks = torch.randn(6, 8), torch.rand(6, 4)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2, split_input=custom_split))
    with torch.no_grad():
        torch.testing.assert_close(rp(images, masks), ref[0](images, masks))
    assert seen == [(3, 3), (3, 3), (6, 6)]


def test_run_config_split_input_spec():
    """run_config.en.md, "Writing Split Specs" (split_input): (TensorChunkSpec(0), _Replicate) for args, None for kwargs."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

    seen: list[tuple] = []

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 4)

        def forward(self, x, scale):
            seen.append((tuple(x.shape), tuple(scale.shape)))
            return self.proj(x) * scale.mean(0)  # the whole replicated tensor, whatever the micro-batch

    torch.manual_seed(0)
    rp = RoundPipe(nn.Sequential(Scaled()))
    cfg = RoundPipeRunConfig(num_microbatch=3, split_input=((TensorChunkSpec(0), _Replicate), None))
    with torch.no_grad():
        rp(torch.randn(6, 8), torch.rand(6, 4), roundpipe_run_config=cfg)
    assert seen == [((2, 8), (6, 4))] * 3


def test_run_config_split_label_spec():
    """run_config.en.md, "Split Label" / "Writing Split Specs": (_Replicate, TensorChunkSpec(1), _Replicate)."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

    seen: list = []

    def loss_fn(out, label):
        seen.append(label)
        scalar, per_sample, number = label
        return mse_sum(out, per_sample.sum(0)[:, :4]) * scalar * number

    label = (torch.tensor(2.0), torch.randn(3, 12, 4), 42)
    rp = RoundPipe(
        mlp(),
        model_run_config=RoundPipeRunConfig(
            num_microbatch=3, split_label=(_Replicate, TensorChunkSpec(1), _Replicate)
        ),
    )
    rp.forward_backward(input_args=(torch.randn(12, 8),), label=label, loss_fn=loss_fn)
    assert len(seen) == 3
    for i, (scalar, part, number) in enumerate(seen):
        assert scalar == 2.0 and number == 42
        torch.testing.assert_close(part, label[1][:, 4 * i : 4 * (i + 1)])


def test_run_config_split_label_custom_function():
    """run_config.en.md, "Split Label" / "Writing Custom Split Functions": (label, n) -> list of labels."""

    def custom_split_label(label, num_microbatch):
        targets, weights = label
        return list(zip(targets.chunk(num_microbatch), weights.chunk(num_microbatch)))

    def weighted(out, label):
        targets, weights = label
        return (((out - targets) ** 2).sum(-1) * weights).sum()

    model, ref = mlp(), mlp()
    x, targets, weights = torch.randn(6, 8), torch.randn(6, 4), torch.rand(6)
    rp = RoundPipe(
        model, model_run_config=RoundPipeRunConfig(num_microbatch=2, split_label=custom_split_label)
    )
    loss = rp.forward_backward(input_args=(x,), label=(targets, weights), loss_fn=weighted)
    rp.synchronize()
    ref_loss = sum(
        weighted(ref(a), (t, w)) for a, t, w in zip(x.chunk(2), targets.chunk(2), weights.chunk(2))
    )
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_close(model, ref)


def test_run_config_auto_split_and_merge_nested_structures():
    """run_config.en.md, "Automatic Splitting" / "Automatic Merging": nested tuples/lists/dicts, non-tensors replicated."""
    seen: list = []

    class Echo(nn.Module):
        def forward(self, x, pair, *, flag, table):
            seen.append((x.shape[0], pair[0].shape[0], flag, table["name"]))
            return {"x": x * 2, "pair": [pair[0] + 1, pair[1]], "flag": flag, "name": table["name"]}

    rp = RoundPipe(nn.Sequential(Echo()))
    x, first = torch.randn(6, 3), torch.randn(6, 2)
    with torch.no_grad():
        out = rp(
            x,
            (first, "tag"),
            flag=True,
            table={"name": "t"},
            roundpipe_run_config=RoundPipeRunConfig(num_microbatch=3),
        )
    assert seen == [(2, 2, True, "t")] * 3
    torch.testing.assert_close(out["x"], x * 2)
    torch.testing.assert_close(out["pair"][0], first + 1)
    assert out["pair"][1] == "tag" and out["flag"] is True and out["name"] == "t"


def test_run_config_merge_output_spec():
    """run_config.en.md, "Writing Merge Specs": TensorChunkSpec(1) concatenates along dim 1."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec

    class Transposed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 4)

        def forward(self, x):
            return self.proj(x).t()

    torch.manual_seed(0)
    model = nn.Sequential(Transposed())
    ref = copy.deepcopy(model)
    x = torch.randn(6, 8)
    rp = RoundPipe(
        model, model_run_config=RoundPipeRunConfig(num_microbatch=3, merge_output=TensorChunkSpec(1))
    )
    with torch.no_grad():
        torch.testing.assert_close(rp(x), ref(x))


def test_run_config_merge_output_custom_function():
    """run_config.en.md, "Writing Custom Merge Functions": custom_merge(outputs) -> one value."""
    model, ref = mlp(), mlp()
    x = torch.randn(6, 8)
    rp = RoundPipe(
        model,
        model_run_config=RoundPipeRunConfig(num_microbatch=3, merge_output=lambda outs: torch.stack(outs)),
    )
    with torch.no_grad():
        torch.testing.assert_close(rp(x), torch.stack([ref(c) for c in x.chunk(3)]))


def test_run_config_merge_output_false_chains_models():
    """run_config.en.md, "No Merging" and model.en.md ModelExecutePlan.auto example: model1's unmerged output feeds model2."""
    first, second = mlp(0), nn.Sequential(nn.Linear(4, 4))
    ref1, ref2 = copy.deepcopy(first), copy.deepcopy(second)
    rp1, rp2 = RoundPipe(first), RoundPipe(second)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    cfg = RoundPipeRunConfig(num_microbatch=3, merge_output=False)
    with torch.no_grad():
        output1 = rp1.forward(x, roundpipe_run_config=cfg)
    assert len(output1) == 3
    loss = rp2.forward_backward(
        input_args=(output1,), label=y, loss_fn=mse_sum, run_config=RoundPipeRunConfig(num_microbatch=3)
    )
    rp2.synchronize()
    with torch.no_grad():
        hidden = ref1(x)
    ref_loss = chunked_loss(ref2, hidden, y, 3)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_close(second, ref2)


def test_run_config_model_execute_plan_attributes():
    """run_config.en.md, roundpipe.ModelExecutePlan: empty fwd_plan/bwd_plan lists; the two documented 4-layer plans are valid."""
    plan = ModelExecutePlan()
    assert plan.fwd_plan == [] and plan.bwd_plan == []
    plan.fwd_plan = [range(0, 2), range(2, 4)]
    plan.bwd_plan = [range(3, 4), range(2, 3), range(1, 2), range(0, 1)]
    plan.check_valid(4, "train")
    fused = ModelExecutePlan()
    fused.fwd_plan = [range(0, 3)]
    fused.bwd_plan = [range(3, 4), range(2, 3), range(1, 2), range(0, 1)]
    fused.check_valid(4, "fused")
    with pytest.raises(ValueError):
        plan.check_valid(4, "fused")  # the forward plan overlaps the fused stage


def test_run_config_model_execute_plan_auto_single_model():
    """run_config.en.md, ModelExecutePlan.auto(run_type, model, min_stages=..., model_memory_limit=...): one model, one plan, used by a call."""
    model, ref = mlp(), mlp()
    rp = RoundPipe(model)
    plan = ModelExecutePlan.auto("fused", rp, min_stages=2, model_memory_limit=1.0)
    assert isinstance(plan, ModelExecutePlan) and len(plan.bwd_plan) >= 2
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    loss = rp.forward_backward(
        input_args=(x,),
        label=y,
        loss_fn=mse_sum,
        run_config=RoundPipeRunConfig(execute_plan=plan, num_microbatch=3),
    )
    rp.synchronize()
    ref_loss = chunked_loss(ref, x, y, 3)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_close(model, ref)


def test_run_config_model_execute_plan_auto_several_models():
    """run_config.en.md, ModelExecutePlan.auto(run_type, *models): several models give a list of co-optimized plans."""
    rp1, rp2 = RoundPipe(mlp(0)), RoundPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    plans = ModelExecutePlan.auto("fused", rp1, rp2)
    assert len(plans) == 2
    plans[0].check_valid(5, "fused")
    plans[1].check_valid(2, "fused")
