"""Fused CPU AdamW (fp32 states) against the foreach path it replaced.

`torch.optim.AdamW(fused=True)` on the CPU and laden's torch fallback (`adamw_fused_cpu_`) run
one pass per tensor; the previous path was `torch._foreach_*` math. The moments match bit for
bit; the params differ by the last bit or so (measured: max relative difference 7e-6, on a
param near 0), hence `assert_close` at fp32 tolerance. Against the C++ kernel the params are
bitwise equal.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from laden.optim import (
    HostAdamW,
    OptimSettings,
    adamw_foreach_,
    adamw_fused_cpu_,
    adamw_scalars,
    adamw_step_,
    build_optimizer,
    cpu_adam_ext,
)

HPARAMS = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1}
NUMEL = 100_003


def _run_torch_adamw(init: torch.Tensor, grads: list[torch.Tensor], **kind: bool) -> list[torch.Tensor]:
    p = init.clone().requires_grad_(True)
    opt = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, **kind)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return [p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]]


def _inputs(num_steps: int = 5) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    return torch.randn(NUMEL), [torch.randn(NUMEL) for _ in range(num_steps)]


def test_fused_cpu_adamw_equals_foreach_adamw():
    init, grads = _inputs()
    fused = _run_torch_adamw(init, grads, fused=True)
    foreach = _run_torch_adamw(init, grads, foreach=True)
    assert_close(fused[0], foreach[0])
    assert torch.equal(fused[1], foreach[1])  # exp_avg: bit for bit
    assert_close(fused[2], foreach[2])


def test_fallback_fused_step_equals_previous_foreach_step():
    init, grads = _inputs()
    fused = [init.clone(), torch.zeros(NUMEL), torch.zeros(NUMEL)]
    foreach = [init.clone(), torch.zeros(NUMEL), torch.zeros(NUMEL)]
    out_fused, out_foreach = (
        torch.empty(NUMEL, dtype=torch.bfloat16),
        torch.empty(NUMEL, dtype=torch.bfloat16),
    )
    for step, g in enumerate(grads, start=1):
        adamw_fused_cpu_(
            [fused[0]], [g], [fused[1]], [fused[2]], step=step, **HPARAMS, params_out_bf16=[out_fused]
        )
        s = adamw_scalars(step=step, **HPARAMS)
        adamw_foreach_([foreach[0]], [g], [foreach[1]], [foreach[2]], s, params_out_bf16=[out_foreach])
    for a, b in zip(fused, foreach):
        assert_close(a, b)
    assert torch.equal(out_fused, fused[0].to(torch.bfloat16))


def test_fallback_takes_bf16_grads_like_fp32_grads_rounded():
    init, grads = _inputs(num_steps=3)
    bf16 = [g.to(torch.bfloat16) for g in grads]
    a = [init.clone(), torch.zeros(NUMEL), torch.zeros(NUMEL)]
    b = [init.clone(), torch.zeros(NUMEL), torch.zeros(NUMEL)]
    for step, (g16, g) in enumerate(zip(bf16, grads), start=1):
        adamw_step_(*a[:1], g16, *a[1:], step=step, **HPARAMS, backend="torch")
        adamw_step_(*b[:1], g.to(torch.bfloat16).float(), *b[1:], step=step, **HPARAMS, backend="torch")
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_fallback_params_equal_cpp_kernel_bitwise():
    library, error = cpu_adam_ext.load_library()
    if library is None:
        pytest.skip(f"CPU Adam C++ extension unavailable: {error}")
    init, grads = _inputs()
    results = {}
    for backend in ("cpp", "torch"):
        p, m, v = init.clone(), torch.zeros(NUMEL), torch.zeros(NUMEL)
        for step, g in enumerate(grads, start=1):
            adamw_step_(p, g, m, v, step=step, **HPARAMS, backend=backend)  # type: ignore[arg-type]
        results[backend] = (p, m, v)
    assert torch.equal(results["torch"][0], results["cpp"][0])
    assert torch.equal(results["torch"][1], results["cpp"][1])
    assert_close(results["torch"][2], results["cpp"][2])


def test_host_adamw_torch_backend_fused_equals_strided_foreach():
    """A contiguous param takes the fused kernel, a strided view of the same values the foreach math."""
    init, grads = _inputs(num_steps=3)
    contiguous = init.clone()
    strided = torch.stack([init, torch.zeros(NUMEL)], dim=1)[:, 0]  # same values, stride 2
    opts = [
        HostAdamW([t], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, backend="torch")
        for t in (contiguous, strided)
    ]
    for g in grads:
        for opt in opts:
            opt.step_params(opt.param_groups[0]["params"], grads=[g])
    assert_close(contiguous, strided.contiguous())


def test_build_optimizer_fuses_fp32_cpu_params_only():
    fp32 = torch.zeros(3, requires_grad=True)
    bf16 = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
    settings = OptimSettings(type="adam", lr=1e-3)
    assert build_optimizer([fp32], settings).defaults["fused"]
    with pytest.warns(UserWarning, match="adam_bf16"):
        kept = build_optimizer([bf16], settings)  # bf16 states: foreach, as before
    assert kept.defaults["foreach"] and not kept.defaults["fused"]
