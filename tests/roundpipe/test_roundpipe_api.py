"""The RoundPipe library API: streamed == resident, on an nn.Sequential and a tiny Qwen3.

Every test builds the plain PyTorch reference inside the test and compares the loss and
every parameter gradient (or the weights after optimizer steps) with the streamed run, on
the CPU used as the device (the same scheduling code as on GPUs).
"""

from __future__ import annotations

import copy

import pytest
import torch
from roundpipe_cases import mlp, mse_sum, tied_tiny_qwen3
from torch import nn

from laden import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from laden.engine.roundpipe.plan import GIB
from laden.model.split import causal_lm_loss, shift_labels

pytestmark = pytest.mark.usefixtures("one_thread")


PLANS = {
    "hand": ModelExecutePlan(
        fwd_plan=[range(0, 3), range(3, 5)], bwd_plan=[range(5, 7), range(2, 5), range(0, 2)]
    ),
    # backward partition unlike the forward one, single-layer stages
    "mixed": ModelExecutePlan(
        fwd_plan=[range(0, 1), range(1, 2), range(2, 3), range(3, 4)],
        bwd_plan=[range(4, 7), range(3, 4), range(0, 3)],
    ),
    "one_stage": ModelExecutePlan(fwd_plan=[], bwd_plan=[range(0, 7)]),
}


def plan_for(name: str, rp: RoundPipe) -> ModelExecutePlan:
    if name == "auto":  # a limit that forces several stages of about two layers
        limit_gib = 4 * max(rp.layer_bytes(with_grads=True)) / GIB
        plan = ModelExecutePlan.auto("fused", rp, model_memory_limit=limit_gib, min_stages=3)
        assert len(plan.bwd_plan) >= 3 and plan.fwd_plan
        return plan
    return PLANS[name]


def assert_grads_equal(ref: nn.Module, model: nn.Module) -> None:
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, p_ref.grad, msg=name)


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("plan_name", ["auto", *PLANS])
@pytest.mark.parametrize("num_microbatch", [1, 3, 8])
def test_sequential_streamed_equals_resident(grain, plan_name, num_microbatch):
    ref, model = mlp(), mlp()
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    ref_loss = mse_sum(ref(x), y)
    ref_loss.backward()

    rp = RoundPipe(model)
    cfg = RoundPipeRunConfig(
        num_microbatch=num_microbatch, recompute_grain=grain, execute_plan=plan_for(plan_name, rp)
    )
    loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum, run_config=cfg)
    rp.synchronize()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_equal(ref, model)


class Scale(nn.Module):
    """`x * w * v`, where w is applied only on the calls `with_w` lists (a graph that changes per call).

    `calls` is a list, so the engine's shallow shells of the module share the counter.
    """

    def __init__(self, with_w: set[int]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((16,), 0.9))
        self.v = nn.Parameter(torch.full((16,), 1.1))
        self.with_w, self.calls = with_w, [0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calls[0] in self.with_w:
            x = x * self.w
        self.calls[0] += 1
        return x * self.v


def scaled_mlp(with_w: set[int]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), Scale(with_w), nn.Linear(16, 4))


ONE_STAGE = ModelExecutePlan(fwd_plan=[], bwd_plan=[range(0, 4)])


@pytest.mark.parametrize("with_w", [{1}, {0, 2}], ids=["middle", "first_and_last"])
def test_gradients_of_a_changing_graph_are_exact(with_w):
    """Micro-batches whose backward writes different gradients (w only in some): accumulators are sent
    home early only when every micro-batch so far wrote the same ones, and the gradients stay exact."""
    ref, model = scaled_mlp(with_w), scaled_mlp(with_w)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    ref_loss = sum(mse_sum(ref(x[i : i + 2]), y[i : i + 2]) for i in range(0, 6, 2))
    ref_loss.backward()
    rp = RoundPipe(model)
    cfg = RoundPipeRunConfig(num_microbatch=3, execute_plan=ONE_STAGE)
    loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum, run_config=cfg)
    rp.synchronize()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_equal(ref, model)


def test_a_last_microbatch_that_writes_a_sent_gradient_is_refused():
    """Only the last micro-batch uses w, after v's gradient completed (and sent) their group: refused,
    instead of losing w's gradient."""
    rp = RoundPipe(scaled_mlp({2}))
    cfg = RoundPipeRunConfig(num_microbatch=3, execute_plan=ONE_STAGE)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    with pytest.raises(RuntimeError, match="written after its accumulator was sent"):
        rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum, run_config=cfg)


def test_the_garbage_collector_waits_for_the_call_and_runs_again_after_it(monkeypatch):
    """Inside a call (the loss runs in it) the cyclic collector is off; after the call, and after
    a call that failed, it is on again. A caller that turned it off keeps it off. The first
    pipeline of a process runs one full collection itself, after its first call."""
    import gc

    from laden.engine.roundpipe import pipeline

    collections: list[bool] = []
    collect = gc.collect
    monkeypatch.setattr(pipeline.gc, "collect", lambda *args: collections.append(True) or collect(*args))
    monkeypatch.setattr(pipeline, "_collected", False)  # as in a fresh process
    seen: list[bool] = []

    def recording_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen.append(gc.isenabled())
        return mse_sum(out, y)

    def failing_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise ValueError("loss failed")

    rp = RoundPipe(mlp())
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=PLANS["hand"])
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    assert gc.isenabled()
    rp.forward_backward(input_args=(x,), label=y, loss_fn=recording_loss, run_config=cfg)
    assert seen == [False, False] and gc.isenabled()
    assert len(collections) == 1
    rp.forward_backward(input_args=(x,), label=y, loss_fn=recording_loss, run_config=cfg)
    assert len(collections) == 1  # only after the first call
    with pytest.raises(ValueError, match="loss failed"):
        rp.forward_backward(input_args=(x,), label=y, loss_fn=failing_loss, run_config=cfg)
    assert gc.isenabled()
    gc.disable()
    try:
        rp.forward_backward(input_args=(x,), label=y, loss_fn=recording_loss, run_config=cfg)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_dropped_model_frees_its_pipeline_without_the_garbage_collector():
    """No reference cycle holds a pipeline (its parameter groups refer to their members, the members
    to their groups only weakly; a call's tasks are dropped with the call), so dropping the last
    reference frees its host buffers and stops its host threads at once."""
    import gc
    import threading
    import weakref

    def threads() -> set[str]:
        return {t.name for t in threading.enumerate() if t.name.startswith("roundpipe-dropped")}

    gc.disable()
    try:
        rp = RoundPipe(mlp(), name="dropped")
        opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-2)
        x, y = torch.randn(4, 8), torch.randn(4, 4)
        for _ in range(2):
            rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum,
                                run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=PLANS["hand"]))  # fmt: skip
            rp.step(lambda: (opt.step(), opt.zero_grad()))
        rp.synchronize()
        assert threads()
        pipe = weakref.ref(rp.pipe)
        group = weakref.ref(rp.pipe.store.groups[0])
        del rp
        assert pipe() is None and group() is None
        for _ in range(100):  # the executors' threads exit once they see the shutdown
            if not threads():
                break
            threading.Event().wait(0.01)
        assert not threads()
    finally:
        gc.enable()


@pytest.mark.parametrize("pin_model", ["alloc", "register", "off"])
def test_pin_modes_train_identically(pin_model):
    """On the CPU the modes only change the layout (flat vs per tensor); results must not change."""
    ref, model = mlp(), mlp()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    rp = RoundPipe(model, pin_model=pin_model)
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-2)
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=PLANS["hand"])
    for _ in range(2):
        x, y = torch.randn(6, 8), torch.randn(6, 4)
        mse_sum(ref(x), y).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum, run_config=cfg)
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    for p_ref, p in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(p, p_ref)


def seed_example(x: torch.Tensor, y: torch.Tensor, *, two_calls: bool):
    """The seed's gradient-accumulation example, written as the guide writes it."""
    model = RoundPipe(mlp())
    optimizer = torch.optim.AdamW(model.optim_parameters(), lr=1e-2)
    if two_calls:
        config = RoundPipeRunConfig(num_microbatch=2)
        loss1 = model.forward_backward(input_args=(x[:8],), label=y[:8], loss_fn=mse_sum, run_config=config)
        loss2 = model.forward_backward(input_args=(x[8:],), label=y[8:], loss_fn=mse_sum, run_config=config)
        loss = loss1 + loss2
    else:
        config = RoundPipeRunConfig(num_microbatch=4)
        loss = model.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum, run_config=config)
    model.synchronize()
    grads = [p.grad.clone() for p in model.model.parameters()]
    model.step(lambda: (optimizer.step(), optimizer.zero_grad()))
    model.synchronize()
    return loss, grads, [p.detach().clone() for p in model.model.parameters()]


def test_seed_two_call_accumulation_equals_one_call():
    """Two forward_backward calls then one step == one call on the whole batch (grads and weights)."""
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    loss_a, grads_a, weights_a = seed_example(x, y, two_calls=False)
    loss_b, grads_b, weights_b = seed_example(x, y, two_calls=True)
    torch.testing.assert_close(loss_b, loss_a)
    for a, b in zip(grads_a + weights_a, grads_b + weights_b):
        torch.testing.assert_close(b, a)


def test_sync_step_equals_torch_adamw():
    ref, model = mlp(), mlp()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    rp = RoundPipe(model)
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-2, weight_decay=0.1)
    cfg = RoundPipeRunConfig(num_microbatch=3, execute_plan=PLANS["mixed"], recompute_grain="layer")
    for _ in range(4):
        x, y = torch.randn(6, 8), torch.randn(6, 4)
        ref_loss = mse_sum(ref(x), y)
        ref_loss.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum, run_config=cfg)
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        torch.testing.assert_close(loss, ref_loss.detach())
    for p_ref, p in zip(ref.parameters(), model.parameters()):  # no synchronize: a sync step is exact
        torch.testing.assert_close(p, p_ref)


def test_async_step_equals_one_step_stale_reference():
    """Step k's gradients are taken at the weights after update k-1 and applied to those after update k."""
    current = mlp()  # w_k, what the optimizer updates
    opt_ref = torch.optim.AdamW(current.parameters(), lr=1e-2)
    stale = copy.deepcopy(current)  # the weights the next forward/backward sees
    rp = RoundPipe(mlp())
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-2)
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=PLANS["hand"])
    for _ in range(4):
        x, y = torch.randn(6, 8), torch.randn(6, 4)
        ref_loss = mse_sum(stale(x), y)
        ref_loss.backward()
        previous = copy.deepcopy(current)
        for p, q in zip(current.parameters(), stale.parameters()):
            p.grad = q.grad
        opt_ref.step()
        opt_ref.zero_grad()
        stale = previous
        loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum, run_config=cfg)
        rp.step(lambda: (opt.step(), opt.zero_grad()))
        torch.testing.assert_close(loss, ref_loss.detach())
    rp.synchronize()
    for p_ref, p in zip(current.parameters(), rp.model.parameters()):
        torch.testing.assert_close(p, p_ref)


def test_inference_forward_equals_resident():
    ref, model = mlp(), mlp()
    x = torch.randn(10, 8)
    rp = RoundPipe(model)
    out = rp(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=3, execute_plan=PLANS["hand"]))
    torch.testing.assert_close(out, ref(x).detach())


# ---- a tiny Qwen3 through the generic causal-LM split ------------------------------------


def padded_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (4, 10), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[3, 4:] = 0
    labels = shift_labels(torch.where(mask.bool(), ids, -100))
    return ids, mask, labels


def reference_padded_loss(model: nn.Module, ids, mask, labels) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=mask).logits
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
    )


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("num_microbatch", [1, 2, 4])
def test_qwen3_padded_streamed_equals_resident(tiny_model, grain, num_microbatch):
    ref = copy.deepcopy(tiny_model)
    ids, mask, labels = padded_batch(tiny_model.config.vocab_size)
    ref_loss = reference_padded_loss(ref, ids, mask, labels)
    ref_loss.backward()
    rp = RoundPipe(tiny_model)
    assert rp.num_layers == tiny_model.config.num_hidden_layers + 2
    plan = ModelExecutePlan(fwd_plan=[range(0, 3)], bwd_plan=[range(3, 4), range(1, 3), range(0, 1)])
    cfg = RoundPipeRunConfig(num_microbatch=num_microbatch, recompute_grain=grain, execute_plan=plan)
    loss = rp.forward_backward(
        input_kwargs={"input_ids": ids, "attention_mask": mask},
        label=labels,
        loss_fn=causal_lm_loss,
        run_config=cfg,
    )
    rp.synchronize()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_equal(ref, tiny_model)


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_tied_qwen3_gradients_sum_both_uses(grain):
    """Embedding and lm_head are one tensor used by the first and the last stage."""
    model = tied_tiny_qwen3()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ref = copy.deepcopy(model)
    ids, mask, labels = padded_batch(model.config.vocab_size)
    ref_loss = reference_padded_loss(ref, ids, mask, labels)
    ref_loss.backward()
    rp = RoundPipe(model)
    plan = ModelExecutePlan(
        fwd_plan=[range(0, 2), range(2, 3)], bwd_plan=[range(3, 5), range(1, 3), range(0, 1)]
    )
    cfg = RoundPipeRunConfig(num_microbatch=2, recompute_grain=grain, execute_plan=plan)
    loss = rp.forward_backward(
        input_kwargs={"input_ids": ids, "attention_mask": mask},
        label=labels,
        loss_fn=causal_lm_loss,
        run_config=cfg,
    )
    rp.synchronize()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_equal(ref, model)


def packed_row(doc_lengths: list[int], vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (n,), generator=gen) for n in doc_lengths]
    ids = torch.cat(docs)[None]  # [1, T]
    positions = torch.cat([torch.arange(n) for n in doc_lengths])[None]
    labels = torch.cat([shift_labels(d[None])[0] for d in docs])[None]
    cu = torch.tensor([0, *torch.tensor(doc_lengths).cumsum(0).tolist()], dtype=torch.int32)
    kwargs = {"input_ids": ids, "position_ids": positions, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
              "max_length_q": max(doc_lengths), "max_length_k": max(doc_lengths)}  # fmt: skip
    return kwargs, labels, docs


def test_qwen3_packed_rows_equal_per_document_runs(tiny_model):
    """Packed rows (one per micro-batch, via split_input) == the model run on each document alone."""
    ref = copy.deepcopy(tiny_model)
    vocab = tiny_model.config.vocab_size
    rows = [packed_row([5, 3, 6], vocab, seed=2), packed_row([4, 8], vocab, seed=3)]
    ref_loss = sum(
        nn.functional.cross_entropy(
            ref(input_ids=d[None]).logits[0], shift_labels(d[None])[0], reduction="sum"
        )
        for _, _, docs in rows
        for d in docs
    )
    ref_loss.backward()
    rp = RoundPipe(tiny_model)
    cfg = RoundPipeRunConfig(
        num_microbatch=2,
        execute_plan=ModelExecutePlan(fwd_plan=[range(0, 2)], bwd_plan=[range(2, 4), range(0, 2)]),
        split_input=lambda args, kwargs, n: ([(), ()], [rows[0][0], rows[1][0]]),
        split_label=lambda label, n: [rows[0][1], rows[1][1]],
    )
    loss = rp.forward_backward(input_kwargs=rows[0][0], label=None, loss_fn=causal_lm_loss, run_config=cfg)
    rp.synchronize()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_equal(ref, tiny_model)


def test_qwen3_sync_steps_equal_resident_adamw(tiny_model):
    ref = copy.deepcopy(tiny_model)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    rp = RoundPipe(tiny_model, optim_dtype=torch.float32)
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-3)
    cfg = RoundPipeRunConfig(num_microbatch=2, recompute_grain="layer")
    ids, mask, labels = padded_batch(tiny_model.config.vocab_size)
    for _ in range(3):
        reference_padded_loss(ref, ids, mask, labels).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        rp.forward_backward(input_kwargs={"input_ids": ids, "attention_mask": mask}, label=labels,
                            loss_fn=causal_lm_loss, run_config=cfg)  # fmt: skip
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), tiny_model.named_parameters()):
        torch.testing.assert_close(p, p_ref, msg=name)


def test_qwen3_inference_returns_logits(tiny_model):
    ids, mask, _ = padded_batch(tiny_model.config.vocab_size)
    expected = tiny_model(input_ids=ids, attention_mask=mask).logits.detach()
    rp = RoundPipe(tiny_model)
    with torch.no_grad():
        out = rp(
            input_ids=ids, attention_mask=mask, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=2)
        )
    logits = out.logits  # the Hugging Face output type, as the model's own forward returns
    torch.testing.assert_close(logits[mask.bool()], expected[mask.bool()])


def test_tied_weight_sharing_a_group_with_other_params():
    """The first Linear's weight is reused by the last one; its bias shares the weight's parameter
    group. The group's landing (staged: the tied weight's inbox already holds the last stage's
    contribution) must add into the weight but overwrite the bias, whose inbox still holds the
    previous step's gradient (or uninitialised memory on the first step)."""

    def tied_mlp() -> nn.Sequential:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        model[2].weight = model[0].weight
        return model

    ref, model = tied_mlp(), tied_mlp()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    rp = RoundPipe(model)
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
    cfg = RoundPipeRunConfig(
        num_microbatch=2,
        execute_plan=ModelExecutePlan(fwd_plan=[range(0, 2)], bwd_plan=[range(2, 3), range(0, 2)]),
    )
    for _ in range(3):
        x, y = torch.randn(6, 4), torch.randn(6, 4)
        mse_sum(ref(x), y).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum, run_config=cfg)
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(p, p_ref, msg=name)


# ---- errors --------------------------------------------------------------------------------


def test_step_without_optim_parameters_is_refused():
    rp = RoundPipe(mlp())
    rp.forward_backward(input_args=(torch.randn(4, 8),), label=torch.randn(4, 4), loss_fn=mse_sum)
    opt = torch.optim.SGD(rp.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="optim_parameters"):
        rp.step(opt.step)


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="pin_model"):
        RoundPipe(mlp(), pin_model="pinned")
    with pytest.raises(ValueError, match="recompute_grain"):
        RoundPipeRunConfig(recompute_grain="block")
    with pytest.raises(ValueError, match="num_microbatch"):
        RoundPipeRunConfig(num_microbatch=0)
    rp = RoundPipe(mlp())
    bad = ModelExecutePlan(fwd_plan=[range(0, 3)], bwd_plan=[range(4, 7), range(0, 4)])
    with pytest.raises(ValueError, match="fused stage"):
        rp.forward_backward(input_args=(torch.randn(4, 8),), label=torch.randn(4, 4), loss_fn=mse_sum,
                            run_config=RoundPipeRunConfig(execute_plan=bad))  # fmt: skip
    with pytest.raises(ValueError, match="requires grad"):
        rp.forward_backward(input_args=(torch.randn(4, 8, requires_grad=True),), label=torch.randn(4, 4),
                            loss_fn=mse_sum)  # fmt: skip


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_pool_of_three_workers_equals_resident(grain):
    """Three workers share the CPU device: stages run concurrently, handing micro-batches across threads."""
    model = tied_tiny_qwen3()
    ref = copy.deepcopy(model)
    ids, mask, labels = padded_batch(model.config.vocab_size)
    ref_loss = reference_padded_loss(ref, ids, mask, labels)
    ref_loss.backward()
    rp = RoundPipe(model, devices=[torch.device("cpu")] * 3)
    assert rp.num_devices == 3
    plan = ModelExecutePlan(
        fwd_plan=[range(0, 1), range(1, 3)], bwd_plan=[range(3, 5), range(2, 3), range(0, 2)]
    )
    cfg = RoundPipeRunConfig(num_microbatch=4, recompute_grain=grain, execute_plan=plan)
    for _ in range(2):  # twice: the second call accumulates onto the first
        loss = rp.forward_backward(
            input_kwargs={"input_ids": ids, "attention_mask": mask},
            label=labels,
            loss_fn=causal_lm_loss,
            run_config=cfg,
        )
        torch.testing.assert_close(loss, ref_loss.detach())
    rp.synchronize()
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(p.grad, 2 * p_ref.grad, msg=name)


def test_failed_async_step_is_reraised_at_the_next_call():
    rp = RoundPipe(mlp())
    rp.optim_parameters()
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum)

    def broken_step():
        raise ZeroDivisionError("optimizer bug")

    rp.step(broken_step)
    for _ in range(2):  # sticky: the host state is not trustworthy any more
        with pytest.raises(RuntimeError, match="host job failed") as info:
            rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum)
        assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_an_async_step_that_fails_while_the_next_call_runs_is_reraised_by_that_call():
    """The failure happens only once the next call is under way (its loss function has run) and
    late in it: the call reads the other upload buffer and never waits for the failed update's
    weights, yet it reports the failure, because a call waits for the result of the optimizer
    jobs queued before it. (The pause only widens the window in which a call that merely
    looked for failures would return without one; the outcome does not depend on it.)"""
    import threading
    import time

    rp = RoundPipe(mlp())
    rp.optim_parameters()
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum)
    running = threading.Event()

    def late_broken_step():
        assert running.wait(timeout=60), "the next call never ran its loss function"
        time.sleep(0.2)
        raise ZeroDivisionError("optimizer bug")

    def loss_seen_by_the_step(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        running.set()
        return mse_sum(out, labels)

    rp.step(late_broken_step)
    with pytest.raises(RuntimeError, match="host job failed") as info:
        rp.forward_backward(input_args=(x,), label=y, loss_fn=loss_seen_by_the_step)
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_top_level_names_are_the_library_apis_and_the_engine_does_not_import_it():
    """`laden`'s lazy names are exactly `laden.roundpipe.__all__`, and the engine package imports
    without the API package (the dependency goes API -> engine only)."""
    import subprocess
    import sys

    import laden
    import laden.roundpipe

    assert sorted(laden.__all__) == sorted([*laden.roundpipe.__all__, "__version__"])
    for name in laden.roundpipe.__all__:
        assert getattr(laden, name) is getattr(laden.roundpipe, name)
    code = (
        "import sys, laden.engine.roundpipe.engine; "
        "print(sorted(m for m in sys.modules if m.startswith('laden.roundpipe')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
