"""roundpipe on CUDA: streams, events and pinned copies give the same numbers as the CPU device.

Opt-in by hardware (`gpu`, `multigpu` markers). Most tests run in fp32, so the GPU run can
be compared with a plain PyTorch reference on the same GPU at tight tolerances; the bf16
tests (the configuration of the first H200 run, whose loss was NaN) use bf16-sized ones.
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
    """Eight 4 MiB layers streamed one stage at a time never hold the whole model on the GPU.

    Measured above what is allocated before the measured calls: a warm-up call first allocates
    what stays allocated for the life of the process, above all a cuBLAS workspace per (handle,
    stream), 32 MiB each on Hopper (alone as much as 8 layers here: why an absolute bound of
    8 * layer_bytes failed on the H200). Above that baseline, at most:
    - the stage computing: one Linear's weights (1 layer_bytes), its fp32 gradient accumulator
      (1), and in its backward the micro-batch's weight gradient until autograd adds it into the
      accumulator (1); the host optimizer and the master weights take no GPU memory;
    - the next stage with its zeroed accumulator (2), prefetched from the start of the last
      micro-batch of the stage computing (scheduler._prepare_early);
    - activations of the 2 micro-batches of 16 rows x 1024 fp32 (64 KiB per tensor: inputs,
      Linear and GELU outputs, their gradients, the loss): well under 1 MiB.
    5 layer_bytes + 1 MiB < 6 layer_bytes (measured: 5.11), while the whole model resident would
    be 8 layer_bytes of weights alone (16 with gradients).
    """
    model = wide_mlp()
    layer_bytes = 1024 * 1024 * 4
    rp = RoundPipe(model, devices=[torch.device("cuda", 0)])
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-4)
    plan = ModelExecutePlan.uniform(16, stage_layers=2, fused_layers=2)
    x, y = torch.randn(32, 1024), torch.randn(32, 1024)
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan)

    def train_step() -> None:
        rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum, run_config=cfg)
        rp.step(lambda: (opt.step(), opt.zero_grad()))

    train_step()  # warm-up: workspaces and the like
    rp.synchronize()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        train_step()
    rp.synchronize()
    above = torch.cuda.max_memory_allocated() - baseline
    assert above < 6 * layer_bytes, f"{above / layer_bytes:.2f} layers above the baseline"
    assert torch.cuda.memory_allocated() - baseline < layer_bytes  # every stage released


@pytest.mark.parametrize("pin_model", ["alloc", "register"])
def test_cuda_uploads_and_gradient_inboxes_are_page_locked(pin_model):
    """Weights are uploaded from, and gradients land in, page-locked memory (asynchronous copies)."""
    rp = RoundPipe(wide_mlp(num_layers=2, width=256), pin_model=pin_model, devices=[torch.device("cuda", 0)])
    x, y = torch.randn(8, 256), torch.randn(8, 256)
    rp.forward_backward(
        input_args=(x,), label=y, loss_fn=mse_sum, run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    store = rp.pipe.store
    upload_bytes = grad_bytes = 0
    for group in store.groups:
        for hp in group.members:
            assert store.page_locked(hp.uploads[0]), hp.name
            upload_bytes += hp.numel * hp.uploads[0].element_size()
        for flat in group.grad_flats:
            assert store.page_locked(flat), group.index
            grad_bytes += flat.numel() * flat.element_size()
    assert grad_bytes > 0 and store.pinned_bytes() >= upload_bytes + grad_bytes


def test_cuda_default_memory_limit_follows_the_process_memory_fraction():
    """A process capped with set_per_process_memory_fraction plans for the memory it may use."""
    from laden.engine.roundpipe.plan import DEFAULT_MEMORY_FRACTION, GIB, default_memory_limit_gib

    if not hasattr(torch.cuda, "get_per_process_memory_fraction"):
        pytest.skip("this torch cannot report the per-process memory fraction")
    device = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(device).total_memory
    before = torch.cuda.get_per_process_memory_fraction(device)
    try:
        torch.cuda.set_per_process_memory_fraction(0.25, device)
        expected = DEFAULT_MEMORY_FRACTION * int(total * 0.25) / GIB
        assert default_memory_limit_gib([device]) == pytest.approx(expected, rel=1e-6)
    finally:
        torch.cuda.set_per_process_memory_fraction(before, device)


@pytest.mark.parametrize("optim_step", ["sync", "async"])
def test_cuda_bf16_engine_tracks_resident_reference(optim_step):
    """bf16 compute over fp32 masters on the GPU, the configuration of the H200 NaN run: per
    micro-batch fp32 gradient folds (once issued on the default stream), the CUDA varlen attention
    kernel and the fp32-output loss matmul. The resident reference uses SDPA on the same GPU;
    tolerances are bf16-sized (different kernels), far below what a race produces."""
    from roundpipe_cases import (
        check_tracks_mixed_precision_reference,
        reference_optimizer,
        settings,
        tied_model,
    )

    from laden.engine.roundpipe import RoundPipeEngine
    from laden.model.attention import set_attention

    o = settings(gradient_clipping=0.05, lr=1e-3)
    current = tied_model()
    set_attention(current, "sdpa")
    opt = reference_optimizer(current, o)
    engine_model = tied_model()
    set_attention(engine_model, "varlen")
    engine = RoundPipeEngine(engine_model, optim=o, compute_dtype=torch.bfloat16, optim_step=optim_step,
                             min_stages=3, devices=[torch.device("cuda", 0)])  # fmt: skip
    assert len(engine.plan.bwd_plan) >= 3
    check_tracks_mixed_precision_reference(
        engine, current, opt, o, optim_step, device="cuda", rtol_loss=1e-2, rtol_norm=3e-2, master_ratio=0.25
    )


def test_cuda_tied_gradient_kept_on_the_device_equals_the_host_add(monkeypatch):
    """fp32 on the GPU: the head's gradient of the tied embedding waits on the device for the
    embedding's stage (added on the compute stream behind the backward that wrote it) and trains
    as the two host landings added on the host."""
    from roundpipe_cases import assert_same_masters, assert_same_step, make_steps, settings, tied_model

    from laden.engine.roundpipe import RoundPipeEngine
    from laden.engine.roundpipe.pipeline import Pipeline

    o = settings(gradient_clipping=0.05)
    cuda = [torch.device("cuda", 0)]
    kept = RoundPipeEngine(tied_model(), optim=o, compute_dtype=torch.float32, min_stages=3, devices=cuda)
    host = RoundPipeEngine(tied_model(), optim=o, compute_dtype=torch.float32, min_stages=3, devices=cuda)
    carried_params = Pipeline.carried_params
    assert len(kept.pipe.carried_params(kept.plan)) == 1
    for mbs in make_steps(3):
        n = sum(mb.num_loss_tokens for mb in mbs)
        got = kept.train_batch(mbs, global_num_loss_tokens=n)
        monkeypatch.setattr(Pipeline, "carried_params", lambda self, plan: frozenset())
        assert_same_step(got, host.train_batch(mbs, global_num_loss_tokens=n))
        monkeypatch.setattr(Pipeline, "carried_params", carried_params)
    assert_same_masters(kept, host)


def test_cuda_bf16_kernels_only_the_engine_reaches():
    """Pure bf16 compute (no autocast) is the first path to reach two CUDA kernels: the varlen
    attention kernel (under autocast q and k come out of the fp32 norms, so the per-document SDPA
    fallback runs) and the fp32-output bf16 matmul of the chunked loss (under autocast the hidden
    states are fp32). Both against fp32 references, outputs and gradients: if the engine test
    above fails and this one does too, the kernel is the culprit, not the engine."""
    import torch.nn.functional as F

    from laden.model.attention import varlen_attention_forward
    from laden.model.loss import chunked_linear_cross_entropy

    gen = torch.Generator(device="cuda").manual_seed(0)
    cu = torch.tensor([0, 300, 700, 1024], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(1, h, 1024, 64, device="cuda", generator=gen) for h in (8, 2, 2))

    def attention(q, k, v, *, varlen: bool):
        if varlen:
            out, _ = varlen_attention_forward(nn.Module(), q, k, v, None, scaling=0.125,
                                              cu_seq_lens_q=cu, max_length_q=400)  # fmt: skip
            return out
        pieces = []
        for a, b in zip(cu.tolist()[:-1], cu.tolist()[1:]):
            kd, vd = (t[:, :, a:b].repeat_interleave(4, dim=1) for t in (k, v))
            pieces.append(F.scaled_dot_product_attention(q[:, :, a:b], kd, vd, is_causal=True, scale=0.125))
        return torch.cat(pieces, dim=2).transpose(1, 2)  # [B, T, Hq, D]

    grad_out = torch.randn(1, 1024, 8, 64, device="cuda", generator=gen)
    results = []
    for varlen, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        leaves = [t.to(dtype).requires_grad_(True) for t in (q, k, v)]
        out = attention(*leaves, varlen=varlen)
        out.backward(grad_out.to(dtype))
        results.append([out.float(), *(t.grad.float() for t in leaves)])
    for got, want in zip(*results):
        assert torch.isfinite(got).all()
        assert (got - want).norm() <= 2e-2 * want.norm()  # bf16 rounding: ~4e-3

    hidden = torch.randn(3000, 256, device="cuda", generator=gen)
    weight = torch.randn(5000, 256, device="cuda", generator=gen) * 0.05
    labels = torch.randint(0, 5000, (3000,), device="cuda", generator=gen)
    labels[::7] = -100
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        h, w = hidden.to(dtype).requires_grad_(True), weight.to(dtype).requires_grad_(True)
        if dtype == torch.bfloat16:
            loss = chunked_linear_cross_entropy(h, w, labels, chunk_size=1024)
        else:
            loss = F.cross_entropy(h @ w.t(), labels, ignore_index=-100, reduction="sum")
        loss.backward()
        results.append([loss.float(), h.grad.float(), w.grad.float()])
    for got, want in zip(*results):
        assert torch.isfinite(got).all()
        assert (got - want).norm() <= 2e-2 * want.norm()  # bf16 rounding: ~4e-3


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


def test_cuda_compiled_layers_track_eager_engine():
    """actor.roundpipe.compile on CUDA: inductor's fused kernels round differently from eager
    ones, so the bf16 losses of three steps agree to bf16-sized tolerances, not bitwise."""
    from roundpipe_cases import make_steps, settings, tied_model

    from laden.engine.roundpipe import RoundPipeEngine
    from laden.model.attention import set_attention

    losses = []
    for backend in (None, "inductor"):
        model = tied_model()
        set_attention(model, "varlen")
        engine = RoundPipeEngine(model, optim=settings(lr=1e-3), compute_dtype=torch.bfloat16, min_stages=3,
                                 devices=[torch.device("cuda", 0)], compile_backend=backend)  # fmt: skip
        run = []
        for mbs in make_steps(3):
            out = engine.train_batch(mbs, global_num_loss_tokens=sum(mb.num_loss_tokens for mb in mbs))
            run.append(float(out["loss"]))
        losses.append(run)
    eager, compiled = losses
    assert all(torch.isfinite(torch.tensor(compiled)))
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=2e-2, atol=0)


def test_cuda_long_context_knobs_equal_plain_layers():
    """actor.tiled_mlp_tokens on CUDA under bf16 autocast (where CUDA autocast, unlike the CPU's,
    runs reductions in fp32): tiled MLP + lean RMSNorms give the plain model's loss and gradients."""
    from tiny import tiny_qwen3_config
    from transformers import AutoModelForCausalLM

    from laden.model.patches.lean_norm import enable_lean_rmsnorm
    from laden.model.patches.tiled import enable_tiled_mlp

    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(tiny_qwen3_config(vocab_size=64, num_hidden_layers=2)).cuda()
    knobs = copy.deepcopy(plain)
    enable_tiled_mlp(knobs, tile_tokens=8)
    enable_lean_rmsnorm(knobs)
    ids = torch.randint(0, 64, (1, 40), device="cuda")
    results = []
    for model in (plain, knobs):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_p, grads_p), (loss_k, grads_k) = results
    torch.testing.assert_close(loss_k, loss_p, rtol=1e-3, atol=1e-3)
    for name, g in grads_p.items():
        assert (grads_k[name] - g).norm() <= 2e-2 * g.norm() + 1e-6, name


def test_cuda_protocol_forward_custom_objective_and_offload():
    """The `TrainEngine` protocol with a CUDA device, fp32: `forward` and a custom per-token objective
    (its `fields` travel to the GPU with the labels) against the plain CPU references; `offload`
    returns every cached block to the driver and holds nothing on the device, and training after
    `onload` equals never offloading."""
    from protocol_reference import (
        WeightedTokenLoss,
        reference_token_outputs,
        reference_weighted_grads,
        sgd_step_reference,
    )
    from roundpipe_protocol_cases import (
        ADAM,
        BATCHES,
        NORMALIZER,
        SGD,
        STAGED,
        TEMPERATURE,
        tiny_model,
        tokens,
    )

    from laden.engine.base import OffloadedError
    from laden.engine.roundpipe import RoundPipeEngine

    cuda = torch.device("cuda", 0)

    def engine(optim):
        return RoundPipeEngine(tiny_model(), optim=optim, compute_dtype=torch.float32, execute_plan=STAGED,
                               devices=[cuda])  # fmt: skip

    ref = tiny_model()
    stepped = engine(SGD)
    for out, batch in zip(stepped.forward(BATCHES, temperature=TEMPERATURE), BATCHES):
        want = reference_token_outputs(ref, batch, temperature=TEMPERATURE)
        for key in ("logprobs", "entropy"):
            assert out[key].device.type == "cpu"
            torch.testing.assert_close(out[key], want[key], rtol=1e-4, atol=1e-4, msg=key)
    ref_loss, grads = reference_weighted_grads(ref, BATCHES, NORMALIZER)
    loss = stepped.forward_backward(BATCHES, WeightedTokenLoss(), normalizer=NORMALIZER)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-4)
    stepped.optimizer_step()
    want = sgd_step_reference(ref, grads, SGD.lr)
    for name, t in stepped.named_weights(torch.float32):
        torch.testing.assert_close(t, want[name], rtol=1e-4, atol=1e-5, msg=name)

    torch.cuda.synchronize(cuda)
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated(cuda)  # what the process keeps (cuBLAS workspaces, ...)
    runs = []
    for offload in (True, False):
        e = engine(ADAM)
        e.train_batch(BATCHES, global_num_loss_tokens=tokens(BATCHES))
        if offload:
            reserved = torch.cuda.memory_reserved(cuda)
            assert reserved > torch.cuda.memory_allocated(cuda)  # blocks cached for the next step
            e.offload()
            assert torch.cuda.memory_allocated(cuda) <= baseline  # the engine holds nothing there
            assert torch.cuda.memory_reserved(cuda) < reserved  # and the cache went back to the driver
            assert e.pipe.host_buffers.free_bytes() == 0
            with pytest.raises(OffloadedError):
                e.train_batch(BATCHES, global_num_loss_tokens=tokens(BATCHES))
            e.onload()
        e.train_batch(BATCHES[::-1], global_num_loss_tokens=tokens(BATCHES))
        runs.append({name: t.clone() for name, t in e.named_weights(torch.float32)})
    for name, t in runs[1].items():
        torch.testing.assert_close(runs[0][name], t, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("use_preset", [False, True], ids=["wrapped", "preset"])
def test_router_logits_and_aux_loss_come_back_whole_batch_on_cuda(use_preset):
    """The routers run on a device worker thread there: the capture must follow them."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from laden import wrap_model_to_roundpipe

    config = Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, use_cache=False, pad_token_id=0, moe_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    raw = AutoModelForCausalLM.from_config(config).float()
    ref = copy.deepcopy(raw).cuda()
    model = wrap_model_to_roundpipe(
        raw, model_run_config=RoundPipeRunConfig(num_microbatch=2), use_sequential_preset=use_preset,
        devices=[torch.device("cuda", 0)],
    )  # fmt: skip
    ids = torch.randint(1, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
        expected = ref(input_ids=ids.cuda(), attention_mask=mask.cuda(), output_router_logits=True)
    torch.testing.assert_close(out.logits.cpu(), expected.logits.cpu(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.aux_loss.cpu(), expected.aux_loss.cpu(), atol=1e-5, rtol=1e-4)
    assert len(out.router_logits) == len(expected.router_logits) == 2


def test_model_timer_is_fed_from_cuda_events():
    rp = RoundPipe(wide_mlp(num_layers=4, width=256), devices=[torch.device("cuda", 0)])
    x, y = torch.randn(8, 256), torch.randn(8, 256)
    for _ in range(3):
        rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum)
    rp.synchronize()
    torch.cuda.synchronize()
    rp.model_timer.update_times()
    assert rp.model_timer.stage == {"fwd": 2, "re": 2, "bwd": 2}
    source, fwd, bwd = rp.model_timer.get_estimate("fused")
    assert source == "time" and sum(fwd) > 0 and all(b >= f >= 0 for f, b in zip(fwd, bwd))
