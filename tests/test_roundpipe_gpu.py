"""roundpipe on CUDA: streams, events and pinned copies give the same numbers as the CPU device.

Opt-in by hardware (`gpu`, `multigpu` markers). fp32 everywhere, so the GPU run can be
compared with a plain PyTorch reference on the same GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from laden import ModelExecutePlan, RoundPipe, RoundPipeRunConfig

pytestmark = pytest.mark.gpu


def wide_mlp(num_layers: int = 8, width: int = 1024) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(num_layers):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def mse_sum(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum()


@pytest.mark.parametrize("pin_model", ["alloc", "register", "off"])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_cuda_streamed_equals_resident(pin_model, grain):
    model = wide_mlp()
    ref = copy.deepcopy(model).cuda()
    x, y = torch.randn(64, 1024), torch.randn(64, 1024)
    ref_loss = mse_sum(ref(x.cuda()), y.cuda())
    ref_loss.backward()
    rp = RoundPipe(model, pin_model=pin_model, devices=[torch.device("cuda", 0)])
    plan = ModelExecutePlan.uniform(16, stage_layers=2, fused_layers=4, fwd_stage_layers=3)
    cfg = RoundPipeRunConfig(num_microbatch=4, recompute_grain=grain, execute_plan=plan)
    loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum, run_config=cfg)
    rp.synchronize()
    torch.testing.assert_close(loss, ref_loss.detach().cpu(), rtol=1e-4, atol=1e-3)
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad.cpu(), rtol=1e-4, atol=1e-4, msg=name)


def test_cuda_peak_memory_is_a_few_stages():
    """Eight 4 MiB layers streamed one stage at a time never hold the whole model on the GPU."""
    model = wide_mlp()
    layer_bytes = 1024 * 1024 * 4
    rp = RoundPipe(model, devices=[torch.device("cuda", 0)])
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-4)
    plan = ModelExecutePlan.uniform(16, stage_layers=2, fused_layers=2)
    x, y = torch.randn(32, 1024), torch.randn(32, 1024)
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum,
                            run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan))  # fmt: skip
        rp.step(lambda: (opt.step(), opt.zero_grad()))
    rp.synchronize()
    # two stages in flight, each one layer of weights + its gradient accumulator, plus activations
    assert torch.cuda.max_memory_allocated() < 8 * layer_bytes


def test_cuda_async_and_sync_steps_train():
    ref = wide_mlp(num_layers=4, width=256)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    rp = RoundPipe(wide_mlp(num_layers=4, width=256), devices=[torch.device("cuda", 0)])
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-3)
    plan = ModelExecutePlan.uniform(8, stage_layers=2)
    for _ in range(3):
        x, y = torch.randn(16, 256), torch.randn(16, 256)
        mse_sum(ref(x), y).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum,
                            run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan))  # fmt: skip
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    for p_ref, p in zip(ref.parameters(), rp.model.parameters()):
        torch.testing.assert_close(p, p_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.multigpu
def test_two_gpu_pool_equals_one_gpu():
    x, y = torch.randn(64, 1024), torch.randn(64, 1024)
    grads = []
    for devices in ([torch.device("cuda", 0)], [torch.device("cuda", 0), torch.device("cuda", 1)]):
        model = wide_mlp()
        rp = RoundPipe(model, devices=devices)
        plan = ModelExecutePlan.uniform(16, stage_layers=2, fused_layers=2)
        rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum,
                            run_config=RoundPipeRunConfig(num_microbatch=4, execute_plan=plan))  # fmt: skip
        rp.synchronize()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a)
