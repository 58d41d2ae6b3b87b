"""AdamWBF16 (Kahan-compensated bf16 AdamW), build_optimizer, LR schedules and clipping."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch.testing import assert_close

from laden.optim import (
    AdamWBF16,
    OptimSettings,
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm_,
    param_groups_with_decay,
)


def build(params, **settings):
    """The one builder with `OptimSettings(**settings)`; no weight decay unless asked for."""
    return build_optimizer(params, OptimSettings(**{"weight_decay": 0.0, **settings}))


def _weights_away_from_zero(n: int, generator: torch.Generator) -> torch.Tensor:
    """fp32 weights with |w| in [0.5, 1.5], exactly representable in bf16.

    Half a bf16 ulp there is >= 2**-9 ~ 2e-3, so AdamW updates of ~lr = 1e-4 are lost by
    plain bf16 storage: the regime where it stalls.
    """
    sign = torch.where(torch.rand(n, generator=generator) < 0.5, -1.0, 1.0)
    return (sign * (0.5 + torch.rand(n, generator=generator))).bfloat16().float()


def _master(opt: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor:
    """The fp32-equivalent weight an optimizer tracks: p - comp for AdamWBF16, else p."""
    state = opt.state[p]
    return p.detach().float() - state["comp"].float() if "comp" in state else p.detach().float()


# ----------------------------------------------------------------------------- AdamWBF16


def test_adamw_bf16_on_fp32_params_is_adamw():
    torch.manual_seed(0)
    init = [torch.randn(16, 8), torch.randn(8)]
    ours = [t.clone().requires_grad_(True) for t in init]
    ref = [t.clone().requires_grad_(True) for t in init]
    groups = lambda ps: [{"params": [ps[0]], "weight_decay": 0.1}, {"params": [ps[1]]}]  # noqa: E731
    opt = AdamWBF16(groups(ours), lr=1e-2, betas=(0.8, 0.99), eps=1e-6)
    ref_opt = torch.optim.AdamW(
        groups(ref), lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0, foreach=False
    )
    for _ in range(5):
        grads = [torch.randn_like(t) for t in init]
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    for p, q in zip(ours, ref):
        assert_close(p, q, rtol=1e-6, atol=1e-7)
        assert_close(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"], rtol=1e-6, atol=0.0)
        assert "comp" not in opt.state[p]


def _reference_kahan_step(p, comp, m, v, g, *, step, lr, beta1, beta2, eps, wd):
    """The compensated update as the design writes it: y = update - comp; t = p + y; ..."""
    m32 = m.float() * beta1 + (1 - beta1) * g.float()
    v32 = v.float() * beta2 + (1 - beta2) * g.float() ** 2
    denom = (v32 / (1 - beta2**step)).sqrt() + eps
    master = p.float() - comp.float()
    update = -lr * wd * master - lr / (1 - beta1**step) * m32 / denom
    y = update - comp.float()
    t = p.float() + y
    p_new = t.to(torch.bfloat16)
    comp_new = ((p_new.float() - p.float()) - y).to(torch.bfloat16)
    return p_new, comp_new, m32.to(torch.bfloat16), v32.to(torch.bfloat16)


def test_adamw_bf16_matches_reference_kahan_formula():
    g = torch.Generator().manual_seed(0)
    init = torch.randn(4096, generator=g).bfloat16()
    p = init.clone().requires_grad_(True)
    opt = AdamWBF16([p], lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    ref = [init.clone(), torch.zeros_like(init), torch.zeros_like(init), torch.zeros_like(init)]
    for step in range(1, 31):
        grad = torch.randn(4096, generator=g).bfloat16()
        p.grad = grad
        opt.step()
        ref = _reference_kahan_step(
            *ref[:2], *ref[2:], grad, step=step, lr=3e-4, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.1
        )
    p_ref, comp_ref, m_ref, v_ref = ref
    state = opt.state[p]
    # The two formulations round differently in fp32, which flips the last bit of a bf16
    # moment or comp now and then; comp's last bit is ~2**-17 of p and a moment's 0.4% of one
    # update, so master weights agree to a few 2**-17 relative plus a few % of lr.
    assert_close(_master(opt, p), p_ref.float() - comp_ref.float(), rtol=2**-14, atol=0.05 * 3e-4)
    assert_close(p.detach(), p_ref, rtol=2**-7, atol=0.05 * 3e-4)  # a rounding flip: one bf16 ulp
    assert (p.detach() == p_ref).float().mean() > 0.99
    assert_close(state["exp_avg"], m_ref, rtol=2**-7, atol=2**-8)  # |m| < 2: one bf16 ulp
    assert_close(state["exp_avg_sq"], v_ref, rtol=2**-7, atol=0.0)


def test_adamw_bf16_tracks_fp32_adamw_where_plain_bf16_stalls_fixed_grads():
    """Same gradient sequence for all three: the optimizer's own precision, nothing else."""
    g = torch.Generator().manual_seed(1)
    init = _weights_away_from_zero(2048, g)
    mean = torch.randn(2048, generator=g)
    grads = [mean + torch.randn(2048, generator=g) for _ in range(200)]

    def run(dtype, cls):
        p = init.clone().to(dtype).requires_grad_(True)
        opt = cls([p], lr=1e-4, weight_decay=0.1)
        for grad in grads:
            p.grad = grad.to(dtype)
            opt.step()
        return _master(opt, p)

    fp32 = run(torch.float32, torch.optim.AdamW)
    plain_bf16 = run(torch.bfloat16, torch.optim.AdamW)
    kahan = run(torch.bfloat16, AdamWBF16)
    moved = (fp32 - init).norm()
    assert (plain_bf16 - fp32).norm() > 0.9 * moved  # plain bf16 AdamW barely moves
    assert (kahan - fp32).norm() < 0.02 * moved  # bf16 moments cost well under 2%


def test_adamw_bf16_training_matches_fp32_where_plain_bf16_stalls():
    """Three trainings from one init on linear regression: (a) fp32 + AdamW, (b) bf16 + AdamW,
    (c) bf16 + AdamWBF16. Each computes its own gradients from its own (bf16) weights."""
    g = torch.Generator().manual_seed(0)
    d_in, d_out, num_samples = 64, 32, 256
    w_init = _weights_away_from_zero(d_out * d_in, g).view(d_out, d_in)
    w_true = w_init + 0.05 * (2 * torch.rand(d_out, d_in, generator=g) - 1)
    b_true = 0.05 * (2 * torch.rand(d_out, generator=g) - 1)
    x = torch.randn(num_samples, d_in, generator=g)
    y = x @ w_true.T + b_true

    def loss_fn(w, b):  # fp32 math on the stored weights: only the optimizer differs
        return ((x @ w.float().T + b.float() - y) ** 2).mean()

    def train(dtype, cls):
        w = w_init.clone().to(dtype).requires_grad_(True)
        b = torch.zeros(d_out, dtype=dtype, requires_grad=True)
        opt = cls([{"params": [w], "weight_decay": 0.01}, {"params": [b], "weight_decay": 0.0}], lr=3e-4)
        for _ in range(400):
            opt.zero_grad()
            loss_fn(w, b).backward()
            opt.step()
        with torch.no_grad():
            return loss_fn(w, b).item(), w.detach().float(), b.detach().float()

    loss_init = loss_fn(w_init, torch.zeros(d_out)).item()
    loss_a, w_a, b_a = train(torch.float32, torch.optim.AdamW)
    loss_b, w_b, _ = train(torch.bfloat16, torch.optim.AdamW)
    loss_c, w_c, _ = train(torch.bfloat16, AdamWBF16)
    loss_a_in_bf16 = loss_fn(w_a.bfloat16(), b_a.bfloat16()).item()  # the best a bf16 model can hold

    assert loss_a < 1e-3 * loss_init  # the reference converges
    assert loss_b > 0.9 * loss_init  # plain bf16 AdamW stalls
    assert (w_c - w_a).norm() < (w_b - w_a).norm() / 8
    assert loss_c - loss_a < 0.02 * (loss_init - loss_a)
    assert loss_c < 2.5 * loss_a_in_bf16  # at the bf16 quantization floor, not above it


def test_adamw_bf16_state_is_6_bytes_per_param():
    params = [
        torch.zeros(33, 7, dtype=torch.bfloat16, requires_grad=True),
        torch.zeros(5, dtype=torch.bfloat16, requires_grad=True),
    ]
    opt = AdamWBF16(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    num_params = sum(p.numel() for p in params)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    state_tensors = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert {t.dtype for t in state_tensors} == {torch.bfloat16}
    assert sorted(opt.state[params[0]]) == ["comp", "exp_avg", "exp_avg_sq", "step"]
    assert sum(t.numel() * t.element_size() for t in state_tensors) == 6 * num_params
    assert param_bytes == 2 * num_params


def test_adamw_bf16_state_dict_resume_equals_uninterrupted():
    torch.manual_seed(0)
    init = [torch.randn(8, 4).bfloat16(), torch.randn(4)]  # a bf16 and an fp32 param
    grads = [[torch.randn_like(t) for t in init] for _ in range(6)]

    def run(params, opt, steps):
        for step_grads in steps:
            for p, gr in zip(params, step_grads):
                p.grad = gr.clone()
            opt.step()

    full = [t.clone().requires_grad_(True) for t in init]
    full_opt = AdamWBF16(full, lr=1e-3, weight_decay=0.1)
    run(full, full_opt, grads[:3])
    saved_params = [p.detach().clone() for p in full]
    saved_state = copy.deepcopy(full_opt.state_dict())
    run(full, full_opt, grads[3:])

    resumed = [t.clone().requires_grad_(True) for t in saved_params]
    resumed_opt = AdamWBF16(resumed, lr=1e-3, weight_decay=0.1)
    resumed_opt.load_state_dict(saved_state)
    run(resumed, resumed_opt, grads[3:])
    for p, q in zip(full, resumed):
        assert torch.equal(p, q)
        for key, value in full_opt.state[p].items():
            assert (
                torch.equal(value, resumed_opt.state[q][key])
                if key != "step"
                else value == resumed_opt.state[q][key]
            )


@pytest.mark.gpu
def test_adamw_bf16_on_cuda_matches_cpu():
    torch.manual_seed(0)
    init = [torch.randn(257, 33).bfloat16(), torch.randn(100)]
    grads = [[torch.randn_like(t) for t in init] for _ in range(5)]
    runs = []
    for device in ("cpu", "cuda"):
        params = [t.to(device, copy=True).requires_grad_(True) for t in init]
        opt = AdamWBF16(params, lr=3e-4, weight_decay=0.1)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.to(device)
            opt.step()
        runs.append([_master(opt, p).cpu() for p in params])
    for cpu, cuda in zip(*runs):
        assert_close(cuda, cpu, rtol=2**-14, atol=1e-6)


def test_adamw_bf16_rejects_bad_input():
    with pytest.raises(ValueError, match="float16"):
        AdamWBF16([torch.zeros(3, dtype=torch.float16, requires_grad=True)])
    with pytest.raises(ValueError, match="betas"):
        AdamWBF16([torch.zeros(3, requires_grad=True)], betas=(0.9, 1.0))


# ----------------------------------------------------------------------------- build_optimizer


def test_param_groups_with_decay_on_tiny_qwen3(tiny_model):
    named = list(tiny_model.named_parameters())
    groups = param_groups_with_decay(named, weight_decay=0.1)
    decay_ids = {id(p) for p in groups[0]["params"]}
    no_decay_ids = {id(p) for p in groups[1]["params"]}
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    for name, p in named:
        expect_no_decay = p.ndim == 1 or name.endswith(".bias")
        assert (id(p) in no_decay_ids) == expect_no_decay, name
        assert (id(p) in decay_ids) != expect_no_decay, name
    assert any("norm" in name for name, p in named if id(p) in no_decay_ids)


@pytest.mark.parametrize("type", ["adam", "adam_bf16", "sgd"])
def test_named_params_skip_decay_on_biases_and_norms(type):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build(model.named_parameters(), type=type, lr=0.1, weight_decay=0.5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # zero grads: only weight decay moves a param
    opt.step()
    for name, p in model.named_parameters():
        if name == "0.weight":
            # AdamW: w * (1 - lr * wd); SGD's coupled decay: w - lr * wd * w (same value here).
            assert_close(p.detach(), before[name] * (1 - 0.1 * 0.5))
        else:
            assert torch.equal(p.detach(), before[name]), name


def test_build_optimizer_kinds():
    p = torch.zeros(3, requires_grad=True)
    adam = build([p], type="adam", lr=1e-3, weight_decay=0.01, betas=(0.8, 0.9), eps=1e-6)
    assert isinstance(adam, torch.optim.AdamW)
    assert adam.defaults["fused"] and not adam.defaults["foreach"]  # fp32 CPU params: fused
    assert (adam.defaults["betas"], adam.defaults["eps"], adam.param_groups[0]["weight_decay"]) == (
        (0.8, 0.9),
        1e-6,
        0.01,
    )
    sgd = build([p], type="sgd", lr=1e-2, momentum=0.9)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9
    assert isinstance(build([p], type="adam_bf16", lr=1e-3), AdamWBF16)
    with pytest.raises(ValueError, match="adam_bf16"):
        build([p], type="lion", lr=1e-3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty"):
        build([], type="adam", lr=1e-3)


def test_adam_on_bf16_params_warns():
    p = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
    with pytest.warns(UserWarning, match="adam_bf16"):
        build([p], type="adam", lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build([p], type="adam_bf16", lr=1e-3)


@pytest.mark.gpu
def test_adam_on_cuda_is_fused():
    p = torch.zeros(3, device="cuda", requires_grad=True)
    assert build([p], type="adam", lr=1e-3).defaults["fused"]


@pytest.mark.parametrize("type", ["adam", "adam_bf16", "sgd"])
def test_optimizer_and_scheduler_resume_equals_uninterrupted(type):
    torch.manual_seed(0)
    init = torch.randn(6, 5)
    grads = [torch.randn(6, 5) for _ in range(8)]

    def make(weights):
        p = weights.clone().requires_grad_(True)
        opt = build([("w", p)], type=type, lr=0.1, weight_decay=0.1, momentum=0.9 if type == "sgd" else 0.0)
        sched = build_lr_scheduler(opt, type="cosine", total_steps=8, warmup_steps=2, min_lr_ratio=0.1)
        return p, opt, sched

    def run(p, opt, sched, steps):
        for grad in steps:
            p.grad = grad.clone()
            opt.step()
            sched.step()

    p, opt, sched = make(init)
    run(p, opt, sched, grads[:4])
    saved = (p.detach().clone(), copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict()))
    run(p, opt, sched, grads[4:])

    q, opt2, sched2 = make(saved[0])
    opt2.load_state_dict(saved[1])
    sched2.load_state_dict(saved[2])
    run(q, opt2, sched2, grads[4:])
    assert torch.equal(p, q)
    assert sched.get_last_lr() == sched2.get_last_lr()


# ----------------------------------------------------------------------------- schedules


def _lrs(type, *, total_steps, warmup_steps, min_lr_ratio, num_steps, lr=2.0):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = build_lr_scheduler(
        opt, type=type, total_steps=total_steps, warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio
    )
    lrs = []
    for _ in range(num_steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def test_schedule_values_at_key_steps():
    # warm-up 10 steps, decay over the next 100, floor 0.1 * lr, lr = 2.
    cosine = _lrs("cosine", total_steps=110, warmup_steps=10, min_lr_ratio=0.1, num_steps=130)
    linear = _lrs("linear", total_steps=110, warmup_steps=10, min_lr_ratio=0.1, num_steps=130)
    constant = _lrs("constant", total_steps=110, warmup_steps=10, min_lr_ratio=0.1, num_steps=130)
    for lrs in (cosine, linear, constant):
        assert lrs[0] == 0.0 and lrs[5] == pytest.approx(1.0) and lrs[10] == pytest.approx(2.0)
    # cosine: 2 * (0.1 + 0.9 * 0.5 * (1 + cos(pi * progress)))
    assert cosine[35] == pytest.approx(2 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))))  # 1.7364
    assert cosine[60] == pytest.approx(1.1)  # halfway: 2 * (0.1 + 0.45)
    assert cosine[110] == pytest.approx(0.2) and cosine[129] == pytest.approx(0.2)
    # linear: 2 * (0.1 + 0.9 * (1 - progress))
    assert linear[35] == pytest.approx(1.55)
    assert linear[60] == pytest.approx(1.1)
    assert linear[110] == pytest.approx(0.2) and linear[129] == pytest.approx(0.2)
    assert set(constant[10:]) == {2.0}
    assert _lrs("cosine", total_steps=4, warmup_steps=0, min_lr_ratio=0.0, num_steps=5) == pytest.approx(
        [2.0, 2 * 0.5 * (1 + math.cos(math.pi / 4)), 1.0, 2 * 0.5 * (1 + math.cos(3 * math.pi / 4)), 0.0]
    )


def test_schedule_rejects_bad_input():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    with pytest.raises(ValueError, match="warmup_steps"):
        build_lr_scheduler(opt, type="linear", total_steps=10, warmup_steps=11)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        build_lr_scheduler(opt, type="linear", total_steps=10, warmup_steps=0, min_lr_ratio=1.5)
    with pytest.raises(ValueError, match="cosine"):
        build_lr_scheduler(opt, type="step", total_steps=10, warmup_steps=0)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- clipping


@pytest.mark.parametrize("max_norm", [0.0, 1.0, 100.0])
def test_clip_grad_norm(max_norm):
    torch.manual_seed(0)
    params = [
        torch.zeros(3, 4, requires_grad=True),
        torch.zeros(5, requires_grad=True),
        torch.zeros(2, requires_grad=True),
    ]
    params[0].grad, params[1].grad = torch.randn(3, 4), torch.randn(5)  # params[2] has no grad
    grads = [params[0].grad.clone(), params[1].grad.clone()]
    expected_norm = torch.cat([g.flatten() for g in grads]).pow(2).sum().sqrt()
    norm = clip_grad_norm_(params, max_norm)
    assert isinstance(norm, torch.Tensor)
    assert_close(norm, expected_norm)
    scale = min(1.0, max_norm / (expected_norm.item() + 1e-6)) if max_norm > 0 else 1.0
    for p, g in zip(params, grads):
        assert_close(p.grad, g * scale)
    assert params[2].grad is None


@pytest.mark.parametrize(
    ("type", "dtype"), [("adam", torch.float32), ("adam_bf16", torch.bfloat16), ("sgd", torch.float32)]
)
def test_one_builder_same_update_on_device_and_host(type, dtype):
    """What the fsdp engine builds ("device") and what the roundpipe engine builds for its host masters
    ("host") take the same step from the same state, for each `actor.optimizer.type`."""
    torch.manual_seed(0)
    init, grads = torch.randn(8, 4).to(dtype), [torch.randn(8, 4).to(dtype) for _ in range(3)]
    settings = OptimSettings(type=type, lr=0.05, weight_decay=0.1, momentum=0.0)
    results = []
    for where in ("device", "host"):
        p = init.clone().requires_grad_(True)
        opt = build_optimizer([("w", p)], settings, where=where)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        results.append(p.detach().float())
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    assert_close(results[1], results[0], **tol)


def test_adam_on_bf16_masters_warns_the_same_everywhere():
    settings = OptimSettings(type="adam", lr=1e-3)
    messages = []
    for where in ("device", "host"):
        p = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
        with pytest.warns(UserWarning) as record:
            opt = build_optimizer([p], settings, where=where)
        assert isinstance(opt, torch.optim.AdamW)
        messages.append([str(w.message) for w in record])
    assert messages[0] == messages[1] and "adam_bf16" in messages[0][0]
