"""RoundPipeEngine (the config-driven roundpipe backend) == a resident plain-PyTorch reference.

The reference runs the Hugging Face model on each packed document separately, sums the
token losses over the step's global loss-token count, clips with torch's
`clip_grad_norm_` and steps torch's AdamW / SGD on decay / no-decay groups. The engine
streams the same model stage by stage on the CPU device with its host optimizer updating
parameter groups as their gradients land.
"""

from __future__ import annotations

import copy

import pytest
import torch
from roundpipe_cases import (
    SMALL_STAGES,
    STAGED,
    assert_same_masters,
    assert_same_step,
    check_tracks_mixed_precision_reference,
    make_steps,
    reference_loss,
    reference_optimizer,
    settings,
    tied_model,
)
from torch import nn
from transformers import AutoModelForCausalLM

from laden.engine.roundpipe import ModelExecutePlan, RoundPipeEngine
from laden.optim import param_groups_with_decay

# Such a limit also warns when the first batch re-plans the stages with its activations.
pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:the largest layer needs .* activations of:UserWarning"),
]


@pytest.mark.parametrize(
    ("optim_type", "clip", "grain"),
    [("adam", 0.0, "stage"), ("adam", 0.05, "layer"), ("adam", 0.05, "stage"), ("sgd", 0.05, "stage")],
)
def test_sync_engine_equals_resident_reference(optim_type, clip, grain):
    o = settings(type=optim_type, gradient_clipping=clip, momentum=0.9 if optim_type == "sgd" else 0.0)
    ref = tied_model()
    opt = reference_optimizer(ref, o)
    with pytest.warns(UserWarning, match="largest layer"):
        engine = RoundPipeEngine(tied_model(), optim=o, compute_dtype=torch.float32, recompute_grain=grain,
                                 model_memory_limit=SMALL_STAGES)  # fmt: skip
    assert len(engine.plan.bwd_plan) > 2
    for mbs in make_steps(3):
        num_tokens = sum(mb.num_loss_tokens for mb in mbs)
        ref_loss = reference_loss(ref, mbs, num_tokens)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip if clip else float("inf"))
        opt.step()
        opt.zero_grad()
        out = engine.train_batch(mbs, global_num_loss_tokens=num_tokens)
        torch.testing.assert_close(out["loss"], ref_loss)
        torch.testing.assert_close(out["grad_norm"], ref_norm)
    masters = engine.state_dict()["model"]
    for name, p in ref.named_parameters():
        torch.testing.assert_close(masters[name], p.detach(), msg=name)


def test_whole_model_stage_sends_gradients_during_the_last_microbatch(monkeypatch):
    """One stage holding the whole model (the plan when it fits: no recompute) sends every gradient
    accumulator home during the last micro-batch's backward, as soon as it is final, and trains
    exactly like the plan that sends them after it."""
    from laden.engine.roundpipe import residency

    sent: list[tuple[tuple[str, int], bool]] = []
    download = residency._download

    def spy(store, res, key, inbox, on_landed):
        sent.append((key, bool(res.writes)))  # writes are counted until the micro-batch ends
        download(store, res, key, inbox, on_landed)

    monkeypatch.setattr(residency, "_download", spy)
    host_norms: list[int] = []  # vector_norm calls on a host gradient inbox (not on a device accumulator)
    vector_norm = torch.linalg.vector_norm

    def norm_spy(t, *args, **kwargs):
        inboxes = {g.grad_flats[0].data_ptr() for g in one.pipe.store.groups if g.grad_flats}
        if t.data_ptr() in inboxes:
            host_norms.append(t.numel())
        return vector_norm(t, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "vector_norm", norm_spy)
    o = settings(gradient_clipping=0.05)
    one = RoundPipeEngine(tied_model(), optim=o, compute_dtype=torch.float32)
    assert one.plan == ModelExecutePlan(fwd_plan=[], bwd_plan=[range(0, 5)])
    staged = RoundPipeEngine(tied_model(), optim=o, compute_dtype=torch.float32, execute_plan=STAGED)
    assert len(staged.plan.bwd_plan) > 1
    for mbs in make_steps(2):  # 3 micro-batches per step
        n = sum(mb.num_loss_tokens for mb in mbs)
        sent.clear()
        a = one.train_batch(mbs, global_num_loss_tokens=n)
        assert sent and all(during for _, during in sent), sent
        assert len(sent) == len({key for key, _ in sent}) == len(one.pipe.trainable_groups())
        assert host_norms == []  # every inbox is one copy: its norm came from the device
        assert_same_step(a, staged.train_batch(mbs, global_num_loss_tokens=n))
    assert_same_masters(one, staged)


def test_async_engine_equals_one_step_stale_reference():
    o = settings(gradient_clipping=0.05)
    current = tied_model()  # the weights the optimizer updates (w_k)
    opt = reference_optimizer(current, o)
    stale = copy.deepcopy(current)  # the weights the next step computes on (w_{k-1})
    engine = RoundPipeEngine(tied_model(), optim=o, compute_dtype=torch.float32, optim_step="async",
                             execute_plan=STAGED)  # fmt: skip
    for mbs in make_steps(4):
        num_tokens = sum(mb.num_loss_tokens for mb in mbs)
        ref_loss = reference_loss(stale, mbs, num_tokens)
        previous = copy.deepcopy(current)
        for p, q in zip(current.parameters(), stale.parameters()):
            p.grad = q.grad
        torch.nn.utils.clip_grad_norm_(current.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        stale = previous
        out = engine.train_batch(mbs, global_num_loss_tokens=num_tokens)
        torch.testing.assert_close(out["loss"], ref_loss)
    masters = engine.state_dict()["model"]
    for name, p in current.named_parameters():
        torch.testing.assert_close(masters[name], p.detach(), msg=name)


def test_adam_bf16_engine_matches_kahan_reference():
    """bf16 weights, Kahan-compensated bf16 states. One document per row, so that the engine and the
    per-document reference run the same bf16 computation (packing would change bf16 rounding)."""
    o = settings(type="adam_bf16", lr=1e-3)
    ref = tied_model(torch.bfloat16)
    opt = reference_optimizer(ref, o)
    # one stage (the whole model fits): autograd sums the tied weight's two bf16 gradients, as the reference does
    engine = RoundPipeEngine(tied_model(torch.bfloat16), optim=o, compute_dtype=torch.bfloat16)
    for mbs in make_steps(2, docs_per_row=1):
        num_tokens = sum(mb.num_loss_tokens for mb in mbs)
        ref_loss = reference_loss(ref, mbs, num_tokens)
        opt.step()
        opt.zero_grad()
        out = engine.train_batch(mbs, global_num_loss_tokens=num_tokens)
        torch.testing.assert_close(out["loss"], ref_loss)
    masters = engine.state_dict()["model"]
    for name, p in ref.named_parameters():
        assert masters[name].dtype == torch.bfloat16
        torch.testing.assert_close(masters[name], p.detach(), msg=name)


def test_eval_batch_equals_resident_loss():
    ref = tied_model()
    engine = RoundPipeEngine(tied_model(), optim=settings(), compute_dtype=torch.float32, execute_plan=STAGED)
    mbs = make_steps(1)[0]
    num_tokens = sum(mb.num_loss_tokens for mb in mbs)
    expected = reference_loss(ref, mbs, num_tokens)
    torch.testing.assert_close(engine.eval_batch(mbs, global_num_loss_tokens=num_tokens)["loss"], expected)


def test_resumed_equals_uninterrupted():
    steps = make_steps(3)
    o = settings(gradient_clipping=1.0, lr_scheduler_type="cosine", warmup_steps=1)
    whole = RoundPipeEngine(tied_model(), optim=o, compute_dtype=torch.float32, execute_plan=STAGED)
    first = RoundPipeEngine(tied_model(), optim=o, compute_dtype=torch.float32, execute_plan=STAGED)
    for mbs in steps[:2]:
        n = sum(mb.num_loss_tokens for mb in mbs)
        whole.train_batch(mbs, global_num_loss_tokens=n)
        first.train_batch(mbs, global_num_loss_tokens=n)
    state = copy.deepcopy(first.state_dict())
    resumed = RoundPipeEngine(tied_model(), optim=o, compute_dtype=torch.float32, execute_plan=STAGED)
    resumed.load_state_dict(state)
    n = sum(mb.num_loss_tokens for mb in steps[2])
    a = whole.train_batch(steps[2], global_num_loss_tokens=n)
    b = resumed.train_batch(steps[2], global_num_loss_tokens=n)
    torch.testing.assert_close(b["loss"], a["loss"])
    torch.testing.assert_close(b["lr"], a["lr"])
    assert_same_masters(resumed, whole)


def test_export_hf_roundtrip(tmp_path):
    engine = RoundPipeEngine(tied_model(), optim=settings(), compute_dtype=torch.float32, execute_plan=STAGED)
    mbs = make_steps(1)[0]
    engine.train_batch(mbs, global_num_loss_tokens=sum(mb.num_loss_tokens for mb in mbs))
    engine.export_hf(tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    masters = engine.state_dict()["model"]
    for name, p in loaded.named_parameters():
        torch.testing.assert_close(p.detach(), masters[name], msg=name)
    assert engine.num_params == sum(p.numel() for p in loaded.parameters())


def test_plans_protocol_and_config_errors():
    from laden.engine.base import TrainEngine

    engine = RoundPipeEngine(tied_model(), optim=settings(), compute_dtype=torch.float32)
    assert isinstance(engine, TrainEngine)
    assert engine.plan == ModelExecutePlan.auto("fused", engine.pipe)  # one CPU device: one stage fits
    hand = ModelExecutePlan.uniform(5, stage_layers=2, fused_layers=1)
    assert RoundPipeEngine(tied_model(), optim=settings(), execute_plan=hand).plan == hand
    with pytest.raises(ValueError, match="fused stage"):
        RoundPipeEngine(
            tied_model(),
            optim=settings(),
            execute_plan=ModelExecutePlan([range(0, 2)], [range(3, 5), range(0, 3)]),
        )
    with pytest.raises(ValueError, match="optim_step"):
        RoundPipeEngine(tied_model(), optim=settings(), optim_step="later")
    with pytest.raises(ValueError, match="model_type"):
        RoundPipeEngine(nn.Sequential(nn.Linear(2, 2)), optim=settings())


def test_built_from_laden_config():
    from laden.config import config_from_dict
    from laden.engine.factory import build_engine

    cfg = config_from_dict(
        {"actor": {"backend": "roundpipe:d1", "dtype": "float32",
                   "roundpipe": {"recompute_grain": "layer", "pin_model": "off", "optim_step": "async"}}}
    )  # fmt: skip
    engine = build_engine(cfg, tied_model(), total_steps=4, device=torch.device("cpu"))
    assert isinstance(engine, RoundPipeEngine)
    assert (engine.recompute_grain, engine.optim_step) == ("layer", "async")
    mbs = make_steps(1)[0]
    out = engine.train_batch(mbs, global_num_loss_tokens=sum(mb.num_loss_tokens for mb in mbs))
    assert torch.isfinite(out["loss"]) and out["grad_norm"] > 0


def test_fp32_masters_with_bf16_compute_match_mixed_precision_reference():
    """bf16 working copy, fp32 masters and moments; gradients summed over micro-batches in fp32.

    The engine's upload copies (the wrapped model's parameters) must be bf16(master) after
    each step: the host update writes them in the same pass.
    """
    o = settings()
    master = tied_model()
    opt = reference_optimizer(master, o)
    engine = RoundPipeEngine(tied_model(), optim=o, compute_dtype=torch.bfloat16)  # one stage, as adam_bf16's
    for mbs in make_steps(2, docs_per_row=1):
        num_tokens = sum(mb.num_loss_tokens for mb in mbs)
        work = copy.deepcopy(master)  # the bf16 copy the step computes on (buffers stay fp32)
        for p in work.parameters():
            p.data = p.data.to(torch.bfloat16)
        grads = [torch.zeros_like(p) for p in master.parameters()]
        for mb in mbs:  # one micro-batch at a time, summed in fp32 like the engine's accumulators
            reference_loss(work, [mb], num_tokens)
            for g, p in zip(grads, work.parameters()):
                g.add_(p.grad)
                p.grad = None
        for p, g in zip(master.parameters(), grads):
            p.grad = g
        opt.step()
        opt.zero_grad()
        engine.train_batch(mbs, global_num_loss_tokens=num_tokens)
    masters = engine.state_dict()["model"]
    for (name, p), (_, q) in zip(master.named_parameters(), engine.model.named_parameters()):
        torch.testing.assert_close(masters[name], p.detach(), msg=name)
        assert q.dtype == torch.bfloat16
        torch.testing.assert_close(q.detach(), masters[name].to(torch.bfloat16), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("optim_step", ["sync", "async"])
def test_bf16_compute_over_several_stages_tracks_resident_reference(optim_step):
    """bf16 compute, fp32 masters, clipping, about one layer per stage: the loss stays finite and
    tracks a resident mixed-precision step (one step stale in async mode).

    Not bit-exact: across stages the tied embedding's two gradient contributions are summed in
    fp32 (the host inbox), where the resident model sums them in its bf16 `.grad`. So the
    tolerances are bf16-sized: the loss and norm to 1e-3 relative, and each master within 10%
    of the distance the reference moved it (a sign flip of an update would break that).
    """
    o = settings(gradient_clipping=0.05, lr=1e-3)
    current = tied_model()  # the masters the reference optimizer updates
    opt = reference_optimizer(current, o)
    with pytest.warns(UserWarning, match="largest layer"):
        engine = RoundPipeEngine(tied_model(), optim=o, compute_dtype=torch.bfloat16, optim_step=optim_step,
                                 model_memory_limit=SMALL_STAGES)  # fmt: skip
    assert len(engine.plan.bwd_plan) > 2
    check_tracks_mixed_precision_reference(
        engine, current, opt, o, optim_step, device="cpu", rtol_loss=1e-3, rtol_norm=5e-3, master_ratio=0.1
    )


def test_auto_plan_follows_the_longest_microbatch():
    """Planned for 4-token micro-batches, the engine re-plans (smaller stages: their activations
    count) when 25-token rows arrive, to the plan it would have had for them from the start, and
    keeps it for shorter rows; the numbers do not depend on the plan."""
    o = settings(gradient_clipping=0.5)
    short = RoundPipeEngine(tied_model(), optim=o, compute_dtype=torch.float32, model_memory_limit=0.001,
                            max_tokens_per_mb=4)  # fmt: skip
    long = RoundPipeEngine(tied_model(), optim=o, compute_dtype=torch.float32, model_memory_limit=0.001,
                           max_tokens_per_mb=25)  # fmt: skip
    assert len(long.plan.bwd_plan) > len(short.plan.bwd_plan)
    steps = make_steps(2, docs_per_row=5) + make_steps(1, seed=1)
    assert max(mb.num_tokens for mb in steps[0]) == 25
    for mbs in steps:
        n = sum(mb.num_loss_tokens for mb in mbs)
        a = long.train_batch(mbs, global_num_loss_tokens=n)
        b = short.train_batch(mbs, global_num_loss_tokens=n)
        assert short.plan == long.plan
        torch.testing.assert_close(b["loss"], a["loss"])
    assert_same_masters(short, long)


def test_engine_on_a_pool_of_two_workers_equals_one_worker():
    o = settings(gradient_clipping=0.5)
    one = RoundPipeEngine(tied_model(), optim=o, compute_dtype=torch.float32, execute_plan=STAGED)
    with pytest.warns(UserWarning, match="largest layer"):
        two = RoundPipeEngine(tied_model(), optim=o, compute_dtype=torch.float32, model_memory_limit=SMALL_STAGES,
                              devices=[torch.device("cpu")] * 2, recompute_grain="layer")  # fmt: skip
    for mbs in make_steps(2):
        n = sum(mb.num_loss_tokens for mb in mbs)
        a = one.train_batch(mbs, global_num_loss_tokens=n)
        assert_same_step(two.train_batch(mbs, global_num_loss_tokens=n), a)
    assert_same_masters(two, one)


@pytest.mark.parametrize("optim_step", ["sync", "async"])
def test_tied_gradient_kept_on_the_device_equals_the_host_add(monkeypatch, optim_step):
    """The head's gradient of the tied embedding stays on the device until the embedding's stage
    adds it: one landing of that group per step, a direct copy with its norm from the device, and
    the same training as two landings added on the host. Several devices keep the host path."""
    from laden.engine.roundpipe.pipeline import Pipeline

    landings: list[tuple[bool, int | None]] = []  # (staged, the tied group's index or None)
    submit, carried_params = Pipeline._submit_landing, Pipeline.carried_params

    def spy(self, landing, hook):
        group = landing.group if landing.group is not None else landing.param.group
        landings.append((landing.staged, group.index if group.index in tied else None))
        submit(self, landing, hook)

    monkeypatch.setattr(Pipeline, "_submit_landing", spy)
    o = settings(gradient_clipping=0.05)
    with pytest.warns(UserWarning, match="largest layer"):
        kept = RoundPipeEngine(tied_model(), optim=o, compute_dtype=torch.float32, optim_step=optim_step,
                               model_memory_limit=SMALL_STAGES)  # fmt: skip
        host = RoundPipeEngine(tied_model(), optim=o, compute_dtype=torch.float32, optim_step=optim_step,
                               model_memory_limit=SMALL_STAGES)  # fmt: skip
        pool = RoundPipeEngine(tied_model(), optim=o, compute_dtype=torch.float32, optim_step=optim_step,
                               model_memory_limit=SMALL_STAGES, devices=[torch.device("cpu")] * 2)  # fmt: skip
    tied = {g.index for g in kept.pipe.store.layout.tied_groups()}
    embed = kept.pipe.store.layers[0].groups[0]
    assert tied == {embed.index} and kept.plan == host.plan and len(kept.plan.bwd_plan) > 2
    assert len(kept.pipe.carried_params(kept.plan)) == 1  # the head's use of the embedding
    assert pool.pipe.carried_params(pool.plan) == frozenset()
    for mbs in make_steps(3):
        n = sum(mb.num_loss_tokens for mb in mbs)
        landings.clear()
        got = kept.train_batch(mbs, global_num_loss_tokens=n)
        assert [k for k in landings if k[1] is not None] == [(False, embed.index)]
        monkeypatch.setattr(Pipeline, "carried_params", lambda self, plan: frozenset())
        landings.clear()
        want = host.train_batch(mbs, global_num_loss_tokens=n)
        assert [k for k in landings if k[1] is not None] == [(False, embed.index), (True, embed.index)]
        assert_same_step(got, want)
        assert_same_step(pool.train_batch(mbs, global_num_loss_tokens=n), want)
        monkeypatch.setattr(Pipeline, "carried_params", carried_params)
    assert_same_masters(kept, host)
    assert_same_masters(pool, host)


def test_failed_step_leaves_no_gradients_so_a_retry_is_exact(monkeypatch):
    """An out-of-memory error in a late backward stage, after earlier stages' gradients landed,
    must not leak partial gradients into the retried step."""
    from laden.engine.roundpipe import passes

    steps = make_steps(2)
    o = settings(gradient_clipping=1.0)
    clean = RoundPipeEngine(tied_model(), optim=o, compute_dtype=torch.float32, execute_plan=STAGED)
    with pytest.warns(UserWarning, match="largest layer"):
        retried = RoundPipeEngine(
            tied_model(), optim=o, compute_dtype=torch.float32, model_memory_limit=SMALL_STAGES
        )
    assert len(retried.plan.bwd_plan) >= 4
    real_backward, calls = passes.run_backward, []

    def oom_on_third_stage(task, lane, res):
        calls.append(task.layers)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("injected")
        real_backward(task, lane, res)

    monkeypatch.setattr(passes, "run_backward", oom_on_third_stage)
    n = sum(mb.num_loss_tokens for mb in steps[0])
    with pytest.raises(torch.OutOfMemoryError):
        retried.train_batch(steps[0], global_num_loss_tokens=n)
    monkeypatch.setattr(passes, "run_backward", real_backward)
    for mbs in steps:
        n = sum(mb.num_loss_tokens for mb in mbs)
        a = clean.train_batch(mbs, global_num_loss_tokens=n)
        assert_same_step(retried.train_batch(mbs, global_num_loss_tokens=n), a)
    assert_same_masters(retried, clean)


def test_config_knobs_of_the_loss_and_recompute_reach_the_engine(recwarn):
    """`actor.chunked_loss` / `loss_chunk_size` make the default objective (full-logit cross-entropy
    trains to the reference loss too); `actor.gradient_checkpointing` warns once, naming the knob
    that roundpipe has instead."""
    from laden.config import config_from_dict
    from laden.engine.factory import build_engine
    from laden.engine.roundpipe.engine import GRADIENT_CHECKPOINTING_IGNORED
    from laden.model.objective import CrossEntropy

    cfg = config_from_dict(
        {"actor": {"backend": "roundpipe:d1", "dtype": "float32", "chunked_loss": False, "loss_chunk_size": 16,
                   "gradient_checkpointing": True, "roundpipe": {"pin_model": "off"}}}
    )  # fmt: skip
    engine = build_engine(cfg, tied_model(), total_steps=4, device=torch.device("cpu"))
    ignored = [w for w in recwarn.list if str(w.message) == GRADIENT_CHECKPOINTING_IGNORED]
    assert len(ignored) == 1 and "actor.roundpipe.recompute_grain=layer" in GRADIENT_CHECKPOINTING_IGNORED
    assert isinstance(engine, RoundPipeEngine)
    assert engine.objective == CrossEntropy(chunked=False, chunk_size=16) and engine.loss_chunk_size == 16
    mbs = make_steps(1)[0]
    n = sum(mb.num_loss_tokens for mb in mbs)
    torch.testing.assert_close(
        engine.train_batch(mbs, global_num_loss_tokens=n)["loss"], reference_loss(tied_model(), mbs, n)
    )
    cfg.actor.gradient_checkpointing = False
    recwarn.clear()
    build_engine(cfg, tied_model(), total_steps=4, device=torch.device("cpu"))
    assert not [w for w in recwarn.list if str(w.message) == GRADIENT_CHECKPOINTING_IGNORED]


def test_adam_on_bf16_masters_is_torch_adamw_as_in_every_engine():
    """`adam` with `optimizer_dtype=bfloat16`: the builder's `torch.optim.AdamW` on the bf16 masters
    (warned), stepped group by group, equals torch's AdamW stepping the resident bf16 model (both on
    the CPU, so that the bf16 kernels round alike)."""
    o = settings(lr=1e-3)
    ref = tied_model(torch.bfloat16)
    groups = param_groups_with_decay(ref.named_parameters(), o.weight_decay)
    opt = torch.optim.AdamW(groups, lr=o.lr, eps=o.eps, foreach=True)
    with pytest.warns(UserWarning, match="adam_bf16"):
        engine = RoundPipeEngine(tied_model(torch.bfloat16), optim=o, compute_dtype=torch.bfloat16,
                                 optimizer_dtype=torch.bfloat16, devices=[torch.device("cpu")])  # fmt: skip
    assert type(engine.optimizer) is torch.optim.AdamW
    for mbs in make_steps(2, docs_per_row=1):
        num_tokens = sum(mb.num_loss_tokens for mb in mbs)
        ref_loss = reference_loss(ref, mbs, num_tokens)
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(
            engine.train_batch(mbs, global_num_loss_tokens=num_tokens)["loss"], ref_loss
        )
    masters = engine.state_dict()["model"]
    for name, p in ref.named_parameters():
        assert masters[name].dtype == torch.bfloat16
        torch.testing.assert_close(masters[name], p.detach(), msg=name)
