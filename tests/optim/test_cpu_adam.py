"""Host AdamW: C++ kernels and torch fallback against torch.optim.AdamW and AdamWBF16."""

from __future__ import annotations

import copy
import logging
import random

import pytest
import torch
from torch.testing import assert_close

from laden.optim import (
    AdamWBF16,
    HostAdamW,
    adamw_bf16_kahan_step_,
    adamw_step_,
    backend_name,
    cpu_adam,
    cpu_adam_ext,
)

HPARAMS = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1}


@pytest.fixture(scope="module")
def cpp_built():
    """Build the extension once for the module; skip cpp tests when it cannot be built."""
    library, error = cpu_adam_ext.load_library()
    if library is None:
        pytest.skip(f"CPU Adam C++ extension unavailable: {error}")
    return library


@pytest.fixture(params=["cpp", "torch"])
def backend(request):
    if request.param == "cpp":
        request.getfixturevalue("cpp_built")
    return request.param


def _torch_adamw_reference(init: torch.Tensor, grads: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
    p = init.clone().requires_grad_(True)
    opt = torch.optim.AdamW(
        [p], lr=HPARAMS["lr"], betas=(HPARAMS["beta1"], HPARAMS["beta2"]), eps=HPARAMS["eps"],
        weight_decay=HPARAMS["weight_decay"], foreach=False,
    )  # fmt: skip
    for grad in grads:
        p.grad = grad.float()
        opt.step()
    return p.detach(), opt.state[p]


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_adamw_step_matches_torch_adamw(backend, grad_dtype):
    torch.manual_seed(0)
    numel = 100_003  # not a multiple of any vector width; large enough to use threads
    init = torch.randn(numel)
    grads = [torch.randn(numel).to(grad_dtype) for _ in range(5)]
    p, m, v = init.clone(), torch.zeros(numel), torch.zeros(numel)
    for step, grad in enumerate(grads, start=1):
        adamw_step_(p, grad, m, v, step=step, **HPARAMS, backend=backend)
    p_ref, state_ref = _torch_adamw_reference(init, grads)
    assert_close(p, p_ref, rtol=1e-6, atol=1e-7)
    assert_close(m, state_ref["exp_avg"], rtol=1e-6, atol=1e-7)
    assert_close(v, state_ref["exp_avg_sq"], rtol=1e-6, atol=1e-9)


def test_param_out_bf16_equals_param_to_bf16(backend):
    torch.manual_seed(0)
    p = torch.randn(70_000) * 10
    grad = torch.randn(70_000)
    out = torch.empty(70_000, dtype=torch.bfloat16)
    adamw_step_(
        p,
        grad,
        torch.zeros_like(p),
        torch.zeros_like(p),
        step=1,
        **HPARAMS,
        param_out_bf16=out,
        backend=backend,
    )
    assert torch.equal(out, p.to(torch.bfloat16))


def test_param_out_bf16_rounding_edge_cases(backend):
    """lr=0 leaves the param as is, so the bf16 copy is a pure conversion: ties to even, NaN, inf."""
    bits = torch.tensor(
        [0x3F808000, 0x3F818000, 0x3F80C000, 0x3F807FFF, 0x7F7FFFFF, 0x00000001, 0x80400000,
         0x7F800000, 0xFF800000, 0x7FC00001, 0xFFC00010, 0x3F800000],
        dtype=torch.int64,
    ).to(torch.int32)  # fmt: skip
    p = bits.view(torch.float32).clone()
    out = torch.empty_like(p, dtype=torch.bfloat16)
    hparams = dict(HPARAMS, lr=0.0)
    adamw_step_(
        p,
        torch.ones_like(p),
        torch.zeros_like(p),
        torch.zeros_like(p),
        step=1,
        **hparams,
        param_out_bf16=out,
        backend=backend,
    )
    assert torch.equal(p.view(torch.int32), bits)
    expected = p.to(torch.bfloat16)
    finite_or_inf = ~expected.isnan()  # NaN payloads differ between PyTorch's own code paths
    assert torch.equal(out[finite_or_inf].view(torch.int16), expected[finite_or_inf].view(torch.int16))
    assert torch.equal(out.isnan(), expected.isnan()) and expected.isnan().sum() == 2


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_kahan_step_matches_adamw_bf16(backend, grad_dtype):
    torch.manual_seed(0)
    numel = 50_001
    init = torch.randn(numel).bfloat16()
    grads = [torch.randn(numel).bfloat16() for _ in range(10)]
    ref = init.clone().requires_grad_(True)
    ref_opt = AdamWBF16([ref], lr=3e-4, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    p, comp, m, v = init.clone(), *(torch.zeros_like(init) for _ in range(3))
    for step, grad in enumerate(grads, start=1):
        ref.grad = grad
        ref_opt.step()
        # Same values either way; fp32 exercises the kernel's fp32-grad path.
        kernel_grad = grad.to(grad_dtype)
        adamw_bf16_kahan_step_(
            p, comp, kernel_grad, m, v, step=step, **dict(HPARAMS, lr=3e-4), backend=backend
        )
    state = ref_opt.state[ref]
    master = p.float() - comp.float()
    assert_close(master, ref.detach().float() - state["comp"].float(), rtol=2**-16, atol=1e-7)
    assert_close(p, ref.detach(), rtol=2**-7, atol=1e-6)  # at most a rare last-bit flip
    assert (p == ref.detach()).float().mean() > 0.999
    assert_close(m, state["exp_avg"])
    assert_close(v, state["exp_avg_sq"])


def test_non_contiguous_tensors_take_the_torch_path(cpp_built):
    torch.manual_seed(0)
    tensors = [torch.randn(64, 32).t() for _ in range(2)] + [torch.zeros(64, 32).t() for _ in range(2)]
    copies = [t.clone() for t in tensors]
    adamw_step_(*tensors, step=1, **HPARAMS, backend="cpp")
    adamw_step_(*copies, step=1, **HPARAMS, backend="torch")
    for a, b in zip(tensors, copies):
        assert torch.equal(a, b)


def test_functional_api_rejects_mismatched_tensors():
    p = torch.zeros(8)
    with pytest.raises(ValueError, match="exp_avg_sq"):
        adamw_step_(p, torch.zeros(8), torch.zeros(8), torch.zeros(7), step=1, **HPARAMS)
    with pytest.raises(ValueError, match="param_bf16"):
        adamw_bf16_kahan_step_(
            p, *(torch.zeros(8, dtype=torch.bfloat16) for _ in range(4)), step=1, **HPARAMS
        )


# ----------------------------------------------------------------------------- HostAdamW


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(40_000,), (33, 17), (5,), (3, 4, 5)]
    return [torch.randn(shape, generator=g).to(dtype).requires_grad_(True) for shape in shapes]


def _groups(params):
    return [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0}]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_step_params_over_a_partition_equals_step(backend, state_dtype):
    whole, parts = _params(state_dtype), _params(state_dtype)
    opt_whole = HostAdamW(_groups(whole), lr=1e-2, weight_decay=0.1, state_dtype=state_dtype, backend=backend)
    opt_parts = HostAdamW(_groups(parts), lr=1e-2, weight_decay=0.1, state_dtype=state_dtype, backend=backend)
    rng = random.Random(0)
    for _ in range(3):
        for p, q in zip(whole, parts):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt_whole.step()
        order = list(range(len(parts)))
        rng.shuffle(order)  # e.g. [2, 0, 3, 1]: layers finish backward in any order
        opt_parts.step_params([parts[i] for i in order[:2]])
        opt_parts.step_params([parts[i] for i in order[2:]])
    for p, q in zip(whole, parts):
        assert torch.equal(p, q)
        for key, value in opt_whole.state[p].items():
            other = opt_parts.state[q][key]
            assert torch.equal(value, other) if key != "step" else value == other == 3


def test_host_adamw_matches_torch_adamw_with_bf16_grads_and_upload_copy(backend):
    params = _params(torch.float32)
    ref = [p.detach().clone().requires_grad_(True) for p in params]
    opt = HostAdamW(_groups(params), lr=1e-2, weight_decay=0.1, backend=backend)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2, weight_decay=0.1, foreach=False)
    outs = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    for _ in range(3):
        grads = [torch.randn_like(p).bfloat16() for p in params]  # what the GPU sends back
        for q, g in zip(ref, grads):
            q.grad = g.float()
        opt.step_params(params, grads=grads, params_out_bf16=outs)
        ref_opt.step()
    for p, q, out in zip(params, ref, outs):
        assert_close(p, q, rtol=1e-6, atol=1e-7)
        assert torch.equal(out, p.detach().bfloat16())
    assert {s["exp_avg"].dtype for s in opt.state.values()} == {torch.float32}


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_host_adamw_resume_equals_uninterrupted(backend, state_dtype):
    params = _params(state_dtype)
    opt = HostAdamW(_groups(params), lr=1e-2, weight_decay=0.1, state_dtype=state_dtype, backend=backend)
    grads = [[torch.randn_like(p) for p in params] for _ in range(5)]

    def run(ps, o, steps):
        for step_grads in steps:
            for p, g in zip(ps, step_grads):
                p.grad = g.clone()
            o.step()

    run(params, opt, grads[:2])
    saved = ([p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()))
    run(params, opt, grads[2:])
    resumed = [t.requires_grad_(True) for t in saved[0]]
    opt2 = HostAdamW(_groups(resumed), lr=1e-2, weight_decay=0.1, state_dtype=state_dtype, backend=backend)
    opt2.load_state_dict(saved[1])
    run(resumed, opt2, grads[2:])
    for p, q in zip(params, resumed):
        assert torch.equal(p, q)


def test_host_adamw_resumes_from_torch_adamw_checkpoint():
    """A torch.optim.AdamW state dict (tensor step counters) loads and continues identically."""
    params = _params(torch.float32)
    ref = [p.detach().clone().requires_grad_(True) for p in params]
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2, weight_decay=0.1, foreach=False)
    for q in ref:
        q.grad = torch.randn_like(q)
    ref_opt.step()
    with torch.no_grad():
        for p, q in zip(params, ref):
            p.copy_(q)
    opt = HostAdamW(_groups(params), lr=1e-2, weight_decay=0.1, backend="torch")
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    for p, q in zip(params, ref):
        q.grad = torch.randn_like(q)
        p.grad = q.grad.clone()
    ref_opt.step()
    opt.step()
    for p, q in zip(params, ref):
        assert opt.state[p]["step"] == 2
        assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_host_adamw_rejects_bad_input():
    with pytest.raises(ValueError, match="state_dtype"):
        HostAdamW([torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)], backend="torch")
    opt = HostAdamW([torch.zeros(3, requires_grad=True)], backend="torch")
    with pytest.raises(ValueError, match="not a param"):
        opt.step_params([torch.zeros(3)], grads=[torch.zeros(3)])
    with pytest.raises(ValueError, match="grads"):
        opt.step_params(opt.param_groups[0]["params"], grads=[])


def test_pin_memory_without_cuda_is_ignored_with_a_warning(caplog):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: pinning is honoured")
    with caplog.at_level(logging.WARNING, logger="laden.optim.cpu_adam"):
        opt = HostAdamW([torch.zeros(3, requires_grad=True)], pin_memory=True, backend="torch")
    assert not opt.pin_memory and "pin_memory" in caplog.text


@pytest.mark.gpu
def test_pinned_states():
    p = torch.zeros(16, requires_grad=True)
    opt = HostAdamW([p], pin_memory=True, backend="torch")
    p.grad = torch.ones(16)
    opt.step()
    assert all(opt.state[p][k].is_pinned() for k in ("exp_avg", "exp_avg_sq"))


# ----------------------------------------------------------------------------- backend choice


def test_backend_env_and_fallback(monkeypatch, caplog):
    def no_build():
        return None, "RuntimeError: no C++ compiler"

    monkeypatch.setattr(cpu_adam_ext, "load_library", no_build)
    monkeypatch.setattr(cpu_adam, "_warned_fallback", False)
    monkeypatch.delenv("LADEN_CPU_ADAM", raising=False)
    with caplog.at_level(logging.WARNING, logger="laden.optim.cpu_adam"):
        assert backend_name() == "torch"
        assert backend_name() == "torch"
    assert caplog.text.count("no C++ compiler") == 1  # warned once, with the reason
    monkeypatch.setenv("LADEN_CPU_ADAM", "cpp")
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler"):
        backend_name()
    monkeypatch.setenv("LADEN_CPU_ADAM", "fast")
    with pytest.raises(ValueError, match="LADEN_CPU_ADAM"):
        backend_name()

    def must_not_build():
        raise AssertionError("LADEN_CPU_ADAM=torch must not build the extension")

    monkeypatch.setattr(cpu_adam_ext, "load_library", must_not_build)
    monkeypatch.setenv("LADEN_CPU_ADAM", "torch")
    assert backend_name() == "torch"


def test_backend_is_cpp_when_built(cpp_built, monkeypatch):
    monkeypatch.delenv("LADEN_CPU_ADAM", raising=False)
    assert backend_name() == "cpp"


def test_step_params_after_load_state_dict_follows_live_groups():
    """After load_state_dict an LR schedule's change reaches step_params (groups are re-pointed)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64))
    opt = HostAdamW([p], lr=1e-2, backend="torch")
    p.grad = torch.randn(64)
    opt.step()
    opt.load_state_dict(opt.state_dict())
    opt.param_groups[0]["lr"] = 0.0  # what a scheduler does
    before = p.detach().clone()
    p.grad = torch.randn(64)
    opt.step_params([p])
    torch.testing.assert_close(p.detach(), before, rtol=0, atol=0)
