"""Training semantics of the RoundPipe API, each against a plain PyTorch loop written here.

Training through `forward` (the classic loop), Hugging Face model outputs and loss inputs,
buffers written in forward (BatchNorm statistics) and `model.parameters()` inside `step_fn`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_qwen3_config
from torch import nn
from transformers import AutoModelForCausalLM

from laden import RoundPipe, RoundPipeRunConfig


def mlp(seed: int = 0, norm: bool = False) -> nn.Sequential:
    torch.manual_seed(seed)
    middle: list[nn.Module] = [nn.BatchNorm1d(16)] if norm else [nn.Tanh()]
    return nn.Sequential(nn.Linear(8, 16), *middle, nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))


def batch(seed: int, rows: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)


def sgd_step(optimizer: torch.optim.Optimizer):
    return lambda: (optimizer.step(), optimizer.zero_grad())


def assert_params_equal(ref: nn.Module, model: nn.Module) -> None:
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(p, p_ref, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(("grain", "num_microbatch"), [("stage", 1), ("stage", 3), ("layer", 2)])
def test_classic_loop_equals_torch_loop(grain, num_microbatch):
    ref, model = mlp(), mlp()
    rp = RoundPipe(
        model, model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch, recompute_grain=grain)
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
    for step in range(3):
        x, y = batch(step)
        out_ref = ref(x)
        out = rp(x)
        assert out.requires_grad
        torch.testing.assert_close(out, out_ref)
        loss_ref, loss = F.mse_loss(out_ref, y), F.mse_loss(out, y)
        torch.testing.assert_close(loss, loss_ref)
        loss_ref.backward()
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        rp.step(sgd_step(opt), is_async=False)
    rp.synchronize()
    assert_params_equal(ref, model)


def test_two_classic_backwards_accumulate_like_torch():
    ref, model = mlp(), mlp()
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    (x1, y1), (x2, y2) = batch(1), batch(2)
    for m in (ref, rp):
        (F.mse_loss(m(x1), y1) + 0.5 * F.mse_loss(m(x2), y2)).backward()
    rp.synchronize()
    for p_ref, p in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad)


def test_forward_without_grad_records_no_graph():
    rp = RoundPipe(mlp())
    with torch.no_grad():
        assert not rp(batch(0)[0]).requires_grad
    assert not rp(batch(0)[0], roundpipe_run_config=RoundPipeRunConfig(requires_grad=False)).requires_grad


def test_backward_after_a_step_is_refused():
    rp = RoundPipe(mlp())
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
    x, y = batch(0)
    loss = F.mse_loss(rp(x), y)
    F.mse_loss(rp(x), y).backward()
    rp.step(sgd_step(opt), is_async=False)
    with pytest.raises(RuntimeError, match="Call backward before step"):
        loss.backward()


# ---- Hugging Face outputs and loss inputs --------------------------------------------------


def tiny_lm() -> nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_qwen3_config(vocab_size=64, num_hidden_layers=2)).float()


def lm_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (3, 7), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100
    return ids, labels


def test_hf_preset_inputs_in_forward_backward_equal_hf_loss():
    ref, model = tiny_lm(), tiny_lm()
    ids, labels = lm_batch(ref.config.vocab_size)
    num_items = int((labels[..., 1:] != -100).sum())
    loss_ref = ref(input_ids=ids, labels=labels, num_items_in_batch=num_items).loss
    loss_ref.backward()
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=3))
    loss = rp.forward_backward(
        input_kwargs={
            "input_ids": ids,
            "labels": labels,
            "return_logits": False,
            "num_items_in_batch": num_items,
        },
        loss_fn=lambda out, _: out.loss,
    )
    torch.testing.assert_close(loss, loss_ref.detach())
    rp.synchronize()
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, msg=lambda m, n=name: f"{n}: {m}")


def test_hf_forward_returns_logits_and_loss_and_trains_like_hf():
    ref, model = tiny_lm(), tiny_lm()
    ids, labels = lm_batch(ref.config.vocab_size)
    out_ref = ref(input_ids=ids, labels=labels)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    out = rp(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.logits, out_ref.logits)
    torch.testing.assert_close(out.loss, out_ref.loss)
    out_ref.loss.backward()
    out.loss.backward()
    rp.synchronize()
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, msg=lambda m, n=name: f"{n}: {m}")


# ---- buffers written in forward ------------------------------------------------------------


def assert_buffers_equal(ref: nn.Module, model: nn.Module) -> None:
    for (name, b_ref), (_, b) in zip(ref.named_buffers(), model.named_buffers()):
        torch.testing.assert_close(b, b_ref, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("classic", [False, True])
@pytest.mark.parametrize(("grain", "num_microbatch"), [("stage", 1), ("stage", 2), ("layer", 2)])
def test_batchnorm_statistics_persist_as_in_per_microbatch_torch_loop(classic, grain, num_microbatch):
    ref, model = mlp(norm=True), mlp(norm=True)
    cfg = RoundPipeRunConfig(num_microbatch=num_microbatch, recompute_grain=grain)
    rp = RoundPipe(model, model_run_config=cfg)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
    for step in range(2):
        x, y = batch(step)
        for xc, yc in zip(x.tensor_split(num_microbatch), y.tensor_split(num_microbatch)):
            F.mse_loss(ref(xc), yc, reduction="sum").backward()  # one BatchNorm call per micro-batch
        ref_opt.step()
        ref_opt.zero_grad()
        if classic:
            loss = sum(
                F.mse_loss(
                    rp(xc, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=1)), yc, reduction="sum"
                )
                for xc, yc in zip(x.tensor_split(num_microbatch), y.tensor_split(num_microbatch))
            )
            loss.backward()
        else:
            rp.forward_backward(
                input_args=(x,), label=y, loss_fn=lambda o, t: F.mse_loss(o, t, reduction="sum")
            )
        rp.step(sgd_step(opt), is_async=False)
    rp.synchronize()
    assert_buffers_equal(ref, model)
    assert int(model[1].num_batches_tracked) == 2 * num_microbatch
    assert_params_equal(ref, model)
    ref.eval()
    rp.eval()
    x, _ = batch(9)
    with torch.no_grad():
        torch.testing.assert_close(rp(x), ref(x))


def test_inplace_buffer_update_in_a_train_mode_inference_persists():
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls.add_(1)
            return x

    model = nn.Sequential(nn.Linear(8, 8), Counter())
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=3))
    with torch.no_grad():
        rp(batch(0)[0])
    assert float(model[1].calls) == 3.0  # once per micro-batch, as three plain calls would


# ---- model.parameters() inside step_fn -----------------------------------------------------


def test_clip_grad_norm_of_model_parameters_inside_step_clips_the_masters():
    ref, model = mlp(), mlp()
    rp = RoundPipe(model, optim_dtype=torch.float32)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.5)
    norms: list[torch.Tensor] = []

    def step_fn() -> None:
        norms.append(torch.nn.utils.clip_grad_norm_(rp.parameters(), max_norm=0.01))
        opt.step()
        opt.zero_grad()

    for step in range(2):
        x, y = batch(step)
        F.mse_loss(ref(x), y).backward()
        norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.01)
        ref_opt.step()
        ref_opt.zero_grad()
        rp.forward_backward(
            input_args=(x,),
            label=y,
            loss_fn=lambda o, t: F.mse_loss(o, t, reduction="sum") / t.new_tensor(24.0),
        )
        rp.step(step_fn, is_async=False)
        torch.testing.assert_close(norms[-1], norm_ref)
        assert norm_ref > 0.01  # the clip did change the step
    rp.synchronize()
    assert_params_equal(ref, model)
