"""The last RoundPipe names: `ModelExecutePlan.auto` over several models and its `upper_threshold`,
`ModelTimer`, `wrap_model_to_roundpipe` and `AutoRoundPipe`; each trained against plain PyTorch."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from laden import (
    AutoRoundPipe,
    ModelExecutePlan,
    ModelTimer,
    RoundPipe,
    RoundPipeRunConfig,
    wrap_model_to_roundpipe,
)
from laden.timer import IterTimer

LAYER_BYTES = (8 * 8 + 8) * 4  # one fp32 Linear(8, 8)


def linears(num_layers: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(num_layers)])


def mse_sum(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum()


def stage_bytes(rp: RoundPipe, stage: range, *, with_grads: bool) -> int:
    sizes = rp.layer_bytes(with_grads=with_grads)
    return sum(sizes[i] for i in stage)


def sgd(optimizer: torch.optim.Optimizer):
    def step() -> None:
        optimizer.step()
        optimizer.zero_grad()

    return step


# ---- ModelExecutePlan.auto: upper_threshold and several models ------------------------------


@pytest.mark.parametrize("threshold", [1.1, 2.0, 3.5])
def test_upper_threshold_bounds_every_stage_by_the_costliest_layer(threshold):
    rp = RoundPipe(linears(6))
    bound = threshold * 2 * LAYER_BYTES  # backward: weights + gradients of one layer
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # accepted, not ignored
        plans = {
            t: ModelExecutePlan.auto(t, rp, min_stages=1, upper_threshold=threshold)
            for t in ("train", "fused")
        }
    for run_type, plan in plans.items():
        plan.check_valid(6, run_type)
        assert all(stage_bytes(rp, s, with_grads=False) <= bound for s in plan.fwd_plan)
        assert all(stage_bytes(rp, s, with_grads=True) <= bound for s in plan.bwd_plan)
    per_bwd, per_fwd = int(threshold), int(2 * threshold)  # layers that fit the bound
    assert max(len(s) for s in plans["train"].bwd_plan) == per_bwd
    assert len(plans["train"].fwd_plan) == -(-6 // per_fwd)  # the fewest stages under the bound
    assert len(plans["train"].bwd_plan) == -(-6 // per_bwd)
    assert len(plans["fused"].bwd_plan[0]) <= per_bwd  # the fused stage is not grown past the bound


def test_upper_threshold_exact_plans_for_uniform_layers():
    rp = RoundPipe(linears(6))
    train = ModelExecutePlan.auto("train", rp, min_stages=1, upper_threshold=1.1)
    assert train.fwd_plan == [range(0, 2), range(2, 4), range(4, 6)]
    assert train.bwd_plan == [range(i, i + 1) for i in range(5, -1, -1)]
    infer = ModelExecutePlan.auto(
        "infer", rp, min_stages=1, upper_threshold=2.0
    )  # bound: two layers' weights
    assert infer.fwd_plan == [range(0, 2), range(2, 4), range(4, 6)]
    unbounded = ModelExecutePlan.auto("fused", rp, min_stages=1)
    assert unbounded.bwd_plan == [range(0, 6)]  # the whole model fits: one fused stage


def test_upper_threshold_below_one_is_refused():
    with pytest.raises(ValueError, match="upper_threshold=0.5 must be >= 1"):
        ModelExecutePlan.auto("fused", RoundPipe(linears(2)), upper_threshold=0.5)


def test_auto_over_several_models_returns_one_plan_each_under_one_bound():
    rp1 = RoundPipe(linears(4, seed=1))
    torch.manual_seed(2)
    rp2 = RoundPipe(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 8)))
    plan1, plan2 = ModelExecutePlan.auto("fused", rp1, rp2, min_stages=1, upper_threshold=1.1)
    plan1.check_valid(4, "fused")  # every model's plan is of the run type asked for
    plan2.check_valid(3, "fused")
    with pytest.raises(ValueError):
        plan1.check_valid(4, "train")
    bound = 1.1 * max(rp2.layer_bytes(with_grads=True))  # the costliest layer of all the models
    for rp, plan in ((rp1, plan1), (rp2, plan2)):
        assert all(stage_bytes(rp, s, with_grads=True) <= bound for s in plan.bwd_plan)
        assert all(stage_bytes(rp, s, with_grads=False) <= bound for s in plan.fwd_plan)
    assert len(plan1.bwd_plan) < 4  # small layers share a stage under the bound set by rp2's largest
    assert ModelExecutePlan.auto("infer") == []


def test_training_with_threshold_plans_equals_plain_pytorch():
    model, ref = linears(6, seed=3), linears(6, seed=3)
    torch.manual_seed(4)
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    rp = RoundPipe(model)
    plan = ModelExecutePlan.auto("fused", rp, min_stages=1, upper_threshold=1.1)
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for _ in range(2):
        cfg = RoundPipeRunConfig(execute_plan=plan, num_microbatch=2)
        loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum, run_config=cfg)
        ref_loss = mse_sum(ref(x), y)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach())
        rp.step(sgd(opt), is_async=False)
        sgd(ref_opt)()
    rp.synchronize()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


def test_joint_plan_of_the_first_model_computes_like_pytorch():
    first, second = linears(3, seed=5), linears(2, seed=6)
    ref = copy.deepcopy(first)
    torch.manual_seed(7)
    x = torch.randn(4, 8)
    rp1, rp2 = RoundPipe(first), RoundPipe(second)
    plan1, _ = ModelExecutePlan.auto("fused", rp1, rp2, min_stages=1, upper_threshold=1.1)
    with torch.no_grad():
        out = rp1(x, roundpipe_run_config=RoundPipeRunConfig(execute_plan=plan1, num_microbatch=2))
        torch.testing.assert_close(out, ref(x))
    out = rp1(x, roundpipe_run_config=RoundPipeRunConfig(execute_plan=plan1, num_microbatch=2))  # grad mode
    out.sum().backward()
    ref(x).sum().backward()
    rp1.synchronize()
    for p, q in zip(first.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


# ---- ModelTimer ------------------------------------------------------------------------------


def time_iteration(timer: ModelTimer, stages: list[range]) -> None:
    """One iteration's spans: a forward and a recompute of every layer, a backward per stage."""
    it = IterTimer(timer)
    for action in ("fwd", "re"):
        for i in range(timer.n_layers):
            with it.time_fwd(action, i, None):
                pass
    for stage in stages:
        with it.time_bwd(stage, None):
            pass
    del it  # hands the spans to the timer


def test_model_timer_estimates_bytes_until_timed_then_times():
    layers = list(linears(3))
    timer = ModelTimer(layers)
    source, fwd, bwd = timer.get_estimate("fused")
    assert source == "memory"
    assert fwd == [float(LAYER_BYTES)] * 3
    assert bwd == [float(LAYER_BYTES) * (1 + ModelTimer.BACKWARD_MULTIPLIER)] * 3
    assert timer.get_estimate("infer")[2] == []
    time_iteration(timer, [range(2, 3), range(0, 2)])
    timer.update_times()
    assert timer.stage == {"fwd": 1, "re": 1, "bwd": 1}  # the first iteration is dropped
    assert timer.get_estimate("train")[0] == "memory"
    time_iteration(timer, [range(2, 3), range(0, 2)])
    timer.update_times()
    assert timer.stage == {"fwd": 2, "re": 2, "bwd": 2}
    assert timer.scale["fwd"] == pytest.approx(ModelTimer.SMOOTH_RATE)
    for run_type in ("infer", "train"):
        source, fwd, bwd = timer.get_estimate(run_type)
        assert source == "time"
        assert len(fwd) == 3 and all(t >= 0 for t in fwd)
        assert len(bwd) == (0 if run_type == "infer" else 3)
    assert timer.iter_results.empty() and timer.pending_fwd is None


def test_model_timer_verbose_prints_one_line_per_layer_and_action(capsys, monkeypatch):
    monkeypatch.setattr(ModelTimer, "VERBOSE", True)
    timer = ModelTimer(list(linears(2)))
    for _ in range(2):
        time_iteration(timer, [range(0, 2)])
    timer.update_times()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 * 2 * 3  # each iteration, the dropped first too: 2 layers x (fwd, re, bwd)
    assert sorted(line.split()[2] for line in lines[6:]) == ["bwd", "bwd", "fwd", "fwd", "re", "re"]
    assert all("new record:" in line and "new estimate:" in line for line in lines)
    assert lines[0].endswith(f"new estimate: {float(LAYER_BYTES):.3f} ms")  # before timings: the bytes


def test_model_timer_refuses_layers_timed_unevenly():
    timer = ModelTimer(list(linears(2)))
    it = IterTimer(timer)
    with it.time_fwd("fwd", 0):
        pass
    del it
    with pytest.raises(RuntimeError, match="spans per layer differ"):
        timer.update_times()


# ---- wrap_model_to_roundpipe and AutoRoundPipe ------------------------------------------------


class Net(nn.Module):
    """Not a Sequential: an input layer, a ModuleList chain, a head, and a CPU-side scale."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(8)
        self.embed = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(32, 4)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h) * self.scale


def test_wrap_sequential_is_a_roundpipe_that_trains_like_pytorch():
    model, ref = linears(3, seed=9), linears(3, seed=9)
    rp = wrap_model_to_roundpipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    assert isinstance(rp, RoundPipe) and rp.num_layers == 3
    torch.manual_seed(10)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum)
    ref_loss = mse_sum(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    rp.synchronize()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_wrap_walks_a_custom_module_into_an_auto_roundpipe():
    model = Net()
    auto = wrap_model_to_roundpipe(model, use_sequential_preset=False, name="net")
    assert isinstance(auto, AutoRoundPipe)
    assert isinstance(model.embed, RoundPipe)  # small enough to wrap whole
    assert model.embed.model_run_config.num_microbatch == 1  # under lower_threshold
    assert all(isinstance(b, RoundPipe) and b.num_layers == 2 for b in model.blocks)
    assert [b.model_run_config.merge_output for b in model.blocks] == [False, False, None]
    assert isinstance(model.head, RoundPipe)
    names = [n for n, _ in auto.optim_named_parameters()]
    assert "scale" in names and len(names) == len(list(Net().parameters()))
    with pytest.raises(NotImplementedError, match="no forward_backward"):
        auto.forward_backward(input_args=(torch.randn(2, 8),))


def test_auto_roundpipe_training_equals_plain_pytorch():
    model, ref = Net(), Net()
    auto = wrap_model_to_roundpipe(
        model, use_sequential_preset=False, skip_modules=[model.blocks, model.head],
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )  # fmt: skip
    # skipped: they run on the host; a RoundPipe after them would get an input that requires grad,
    # which laden refuses (gradients for parameters only)
    assert type(model.head) is nn.Linear and type(model.blocks) is nn.ModuleList
    opt = torch.optim.SGD(auto.optim_parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.manual_seed(11)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    for _ in range(2):
        loss = mse_sum(auto(x), y)
        loss.backward()
        ref_loss = mse_sum(ref(x), y)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss)
        auto.step(sgd(opt), is_async=False)
        sgd(ref_opt)()
    auto.synchronize()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=name)


def test_wrap_refusals_say_why():
    with pytest.raises(NotImplementedError, match="no sequential preset"):
        wrap_model_to_roundpipe(Net(), use_sequential_preset=True)
    with pytest.raises(ValueError, match="runs on the host"):
        AutoRoundPipe(Net(), optim_dtype=torch.float64)
    auto = wrap_model_to_roundpipe(Net(), use_sequential_preset=False)
    list(auto.optim_parameters())  # creates the master weights
    with pytest.warns(UserWarning, match="runs synchronously"):
        auto.step(lambda: None)


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("call", ["forward_backward", "forward", "classic"])
def test_roundpipe_feeds_its_model_timer_in_every_call_form(call, grain):
    """Every layer gets the same number of fwd / re / bwd spans per call (a mismatch would raise),
    so two calls move the timer from byte estimates to timings."""
    model = linears(4, seed=8)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2, recompute_grain=grain))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    plan = ModelExecutePlan(fwd_plan=[range(0, 3)], bwd_plan=[range(3, 4), range(1, 3), range(0, 1)])
    cfg = RoundPipeRunConfig(num_microbatch=2, recompute_grain=grain, execute_plan=plan)
    for _ in range(2):
        if call == "forward_backward":
            rp.forward_backward(
                input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).sum(), run_config=cfg
            )
        elif call == "forward":
            with torch.no_grad():
                rp(x)
        else:
            ((rp(x, roundpipe_run_config=cfg) - y) ** 2).sum().backward()
        rp.synchronize()
    timer = rp.model_timer
    assert timer.stage["fwd"] == 2
    assert timer.get_estimate("infer")[0] == "time"
    if call != "forward":
        assert timer.stage["re"] == timer.stage["bwd"] == 2
        source, fwd, bwd = timer.get_estimate("fused")
        assert source == "time" and len(fwd) == len(bwd) == 4 and all(b >= f >= 0 for f, b in zip(fwd, bwd))
