"""The native rollout engine on the CPU, fp32, against plain reference loops written here."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from native_cases import (
    EOS,
    _model,
    _prompts,
    _requests,
    fresh_stop_string,
    reference_greedy,
    teacher_forced_logprobs,
)
from tiny import tiny_qwen3_config
from transformers import AutoModelForCausalLM

from laden.rollout import GenerationRequest, SamplingParams
from laden.rollout.native import NativeEngine
from laden.rollout.native.kernels.options import KernelOptions, SwigluOptions
from laden.rollout.native.scheduler import GenerationOOMError

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(model, **kw) -> NativeEngine:
    kw.setdefault("max_model_len", 128)
    kw.setdefault("max_concurrent", 8)
    return NativeEngine(model, **kw)


@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 7])
@pytest.mark.parametrize("chain", [False, True], ids=["serial", "chained"])
def test_greedy_equals_reference_loop(kind, batch, chain):
    model = _model(kind)
    prompts = _prompts(batch)
    # a stop token the reference meets for some prompts: the most common greedy first token
    firsts = [reference_greedy(model, p, 1, set())[0] for p in prompts]
    stop = max(set(firsts), key=firsts.count)
    engine = _engine(model, decode_steps=3, chain_windows=chain)
    results = engine.generate_sync(_requests(prompts, greedy=True, max_new_tokens=12, stop_token_ids=(stop,)))
    assert [r.rid for r in results] == [f"r{i}" for i in range(batch)]
    for p, r in zip(prompts, results):
        expected = reference_greedy(model, p, 12, {stop, EOS})
        assert r.output_ids == expected
        assert r.stop_reason == ("stop" if expected[-1] in (stop, EOS) else "length")
        assert r.output_versions == [0] * len(expected)
    # chained: windows were launched before the one in flight was read (batch 1 stops at its first
    # token), and every block came back
    assert (engine.core.stats["chained"] > 0) == (chain and batch > 1)
    assert engine.core.cache.allocator.used() == 0


def test_a_llama_with_mlp_biases_runs_its_own_modules():
    """Llama's `mlp_bias`: the layers fall back to the model's modules (the fused path has no MLP
    biases) and greedy decoding still equals the reference loop."""
    model = _model("llama", mlp_bias=True)
    engine = _engine(model)
    assert not engine.paged.functional
    prompts = _prompts(3)
    results = engine.generate_sync(_requests(prompts, greedy=True, max_new_tokens=8, ignore_eos=True))
    for p, r in zip(prompts, results):
        assert r.output_ids == reference_greedy(model, p, 8, set())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chain", [False, True], ids=["serial", "chained"])
def test_logprobs_equal_teacher_forced_forward(temperature, chain):
    model = _model("qwen3")
    prompts = _prompts(5)
    engine = _engine(model, seed=3, chain_windows=chain)
    results = engine.generate_sync(
        _requests(prompts, temperature=temperature, max_new_tokens=10, ignore_eos=True)
    )
    for p, r in zip(prompts, results):
        assert len(r.output_ids) == 10 and r.stop_reason == "length"
        ref = teacher_forced_logprobs(model, p, r.output_ids, temperature)
        torch.testing.assert_close(torch.tensor(r.output_logprobs), ref, atol=1e-5, rtol=1e-5)


def test_logprobs_equal_the_train_engines_forward():
    """The trainer's own teacher-forced `forward` (fsdp engine, one process) gives the same numbers."""
    from laden.data.batch import pack_samples
    from laden.engine.fsdp import FSDPEngine
    from laden.optim import OptimSettings

    model = _model("qwen3")
    prompts = _prompts(3)
    engine = _engine(copy.deepcopy(model), seed=5)
    results = engine.generate_sync(_requests(prompts, temperature=0.8, max_new_tokens=6, ignore_eos=True))
    samples = [
        ([*p, *r.output_ids], [0] * len(p) + [1] * len(r.output_ids)) for p, r in zip(prompts, results)
    ]
    train = FSDPEngine(
        model, dtype=torch.float32, optimizer_dtype=torch.float32, optim=OptimSettings(lr=1e-3)
    )
    batch = pack_samples(samples)
    out = train.forward([batch], outputs=("logprobs",), temperature=0.8)[0]["logprobs"]
    mask = batch.labels != -100
    got = torch.cat([torch.tensor(r.output_logprobs) for r in results])
    torch.testing.assert_close(out[mask], got, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chain", [False, True], ids=["serial", "chained"])
def test_more_requests_than_max_concurrent_each_returned_once(chain):
    model = _model("qwen3")
    prompts = _prompts(11)
    seen_batches: list[int] = []
    engine = _engine(model, max_concurrent=3, decode_steps=2, chain_windows=chain)
    engine.core.oom_hook = lambda phase, b: seen_batches.append(b) if phase == "decode" else None
    reqs = _requests(prompts, temperature=1.0, max_new_tokens=5)
    reqs[4] = GenerationRequest(
        rid="r4", input_ids=prompts[4], sampling=SamplingParams(max_new_tokens=5), n_samples=2
    )

    async def collect():
        return [r async for r in engine.generate(reqs)]

    results = asyncio.run(collect())
    keys = sorted((r.rid, r.sample_index) for r in results)
    expected = sorted([(f"r{i}", 0) for i in range(11)] + [("r4", 1)])
    assert keys == expected
    assert max(seen_batches) == 3  # never more in flight than allowed ...
    assert engine.core.stats["windows"] > 4  # ... so the queue was drained over several windows
    # chained: later prompts were prefilled while a window was in flight
    assert (engine.core.stats["overlapped"] > 0) == chain


def test_prompts_prefilled_behind_a_window_in_flight_equal_the_reference():
    """Chained windows with a queue: each prefill is queued behind the window in flight, which is
    read after it; every completion equals the reference loop."""
    model = _model("qwen3")
    prompts = _prompts(8)
    engine = _engine(model, max_concurrent=3, decode_steps=3, chain_windows=True)
    lengths = [4 + 3 * (i % 3) for i in range(8)]  # places free up at different windows
    reqs = [
        GenerationRequest(rid=f"r{i}", input_ids=p, sampling=SamplingParams(max_new_tokens=n, greedy=True, ignore_eos=True))
        for i, (p, n) in enumerate(zip(prompts, lengths))
    ]  # fmt: skip
    results = engine.generate_sync(reqs)
    assert engine.core.stats["overlapped"] > 0 and engine.core.stats["chained"] > 0
    for p, n, r in zip(prompts, lengths, results):
        assert r.output_ids == reference_greedy(model, p, n, set())
    assert engine.core.cache.allocator.used() == 0
    assert engine.core.cache.allocator.used() == 0  # every block came back


def test_samples_of_one_prompt_share_its_prefill():
    model = _model("qwen3")
    prompt = _prompts(1)[0] + _prompts(1, seed=9)[0]  # 6 + 16 tokens: two full blocks of 8 and a partial one
    engine = _engine(model, block_size=8)
    out = engine.generate_sync(_requests([prompt], greedy=True, max_new_tokens=8, n_samples=4))
    assert engine.core.stats["prefill_tokens"] == len(prompt)  # prefilled once for four completions
    expected = reference_greedy(model, prompt, 8, {EOS})
    assert [r.output_ids for r in out] == [expected] * 4
    sampled = _engine(model, block_size=8, seed=1).generate_sync(
        _requests([prompt], temperature=1.0, max_new_tokens=8, n_samples=4, ignore_eos=True)
    )
    for (
        r
    ) in sampled:  # each completion's log-probs are its own sequence's (the copied partial block is right)
        ref = teacher_forced_logprobs(model, prompt, r.output_ids, 1.0)
        torch.testing.assert_close(torch.tensor(r.output_logprobs), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chain", [False, True], ids=["serial", "chained"])
def test_preemption_when_blocks_run_out_equals_a_big_cache(chain):
    model = _model("qwen3")
    prompts = _prompts(6)
    small = _engine(model, kv_cache_tokens=160, block_size=8, decode_steps=4, chain_windows=chain)
    got = small.generate_sync(_requests(prompts, greedy=True, max_new_tokens=20, ignore_eos=True))
    assert small.core.stats["preempted"] > 0
    for p, r in zip(prompts, got):
        assert r.output_ids == reference_greedy(model, p, 20, set())


@pytest.mark.parametrize("chain", [False, True], ids=["serial", "chained"])
def test_pause_update_resume_tags_each_token_with_its_version(chain):
    old, new = _model("qwen3", seed=0), _model("qwen3", seed=1)
    prompts = _prompts(4)
    engine = _engine(copy.deepcopy(old), decode_steps=2, chain_windows=chain)
    reqs = _requests(prompts, greedy=True, max_new_tokens=10, ignore_eos=True)
    new_state = {k: v.clone() for k, v in new.state_dict().items()}

    async def run():
        gen = engine.generate(reqs)
        first = asyncio.ensure_future(gen.__anext__())
        # let two windows run, then pause at a token boundary and swap the weights
        while engine.core.stats["windows"] < 2:
            await asyncio.sleep(0)
            await asyncio.sleep(0.001)
        await engine.pause()
        before = {s.request.rid: len(s.output) for s in engine.core.scheduler.running}
        await engine.update_weights(new_state.items(), version=1)
        await engine.resume()
        results = [await first] + [r async for r in gen]
        return before, results

    before, results = asyncio.run(run())
    assert before and all(0 < n < 10 for n in before.values())
    for r in results:
        n_old = before[r.rid]
        assert r.output_versions == [0] * n_old + [1] * (10 - n_old)
        p = r.input_ids
        assert r.output_ids[:n_old] == reference_greedy(old, p, n_old, set())
        # the rest continues the same sequence under the new weights
        assert r.output_ids[n_old:] == reference_greedy(new, (*p, *r.output_ids[:n_old]), 10 - n_old, set())


@pytest.mark.parametrize("chain", [False, True], ids=["serial", "chained"])
def test_injected_generation_oom_lowers_concurrency_and_loses_nothing(caplog, chain):
    model = _model("qwen3")
    prompts = _prompts(7)
    reqs = _requests(prompts, greedy=True, max_new_tokens=9, ignore_eos=True)
    failed = []

    def hook(phase, batch):
        if phase == "decode" and batch > 2 and len(failed) < 2:
            failed.append(batch)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    engine = _engine(model, max_concurrent=7, decode_steps=3, chain_windows=chain)
    engine.core.oom_hook = hook
    with caplog.at_level("WARNING"):
        results = engine.generate_sync(reqs)
    assert failed == [7, 3]
    assert engine.core.max_concurrent == 1
    assert "rollout.max_concurrent_rollouts=" in caplog.text and "native.mem_fraction_static=" in caplog.text
    for p, r in zip(prompts, results):
        assert r.output_ids == reference_greedy(model, p, 9, set())
    assert engine.core.cache.allocator.used() == 0


def test_oom_with_one_sequence_raises_with_the_fixes():
    model = _model("qwen3")
    engine = _engine(model, max_concurrent=1)

    def hook(phase, batch):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    engine.core.oom_hook = hook
    with pytest.raises(GenerationOOMError, match="rollout.max_concurrent_rollouts=1.*native:d1t2"):
        engine.generate_sync(_requests(_prompts(1), greedy=True, max_new_tokens=4))


def test_sampling_settings():
    model = _model("qwen3")
    prompts = _prompts(4)
    engine = _engine(model, seed=2)
    greedy = engine.generate_sync(_requests(prompts, greedy=True, max_new_tokens=6, ignore_eos=True))
    top1 = engine.generate_sync(
        _requests(prompts, temperature=1.3, top_k=1, max_new_tokens=6, ignore_eos=True)
    )
    assert [r.output_ids for r in top1] == [r.output_ids for r in greedy]
    tiny_p = engine.generate_sync(
        _requests(prompts, temperature=1.0, top_p=1e-6, max_new_tokens=6, ignore_eos=True)
    )
    assert [r.output_ids for r in tiny_p] == [r.output_ids for r in greedy]
    # min_new_tokens: a stop token that greedy decoding emits first is held back until the minimum
    first = greedy[0].output_ids[0]
    held = engine.generate_sync(
        _requests(prompts[:1], greedy=True, max_new_tokens=6, min_new_tokens=3, stop_token_ids=(first,))
    )[0]
    assert first not in held.output_ids[:3] and len(held.output_ids) >= 3
    stopped = engine.generate_sync(
        _requests(prompts[:1], greedy=True, max_new_tokens=6, stop_token_ids=(first,))
    )[0]
    assert stopped.output_ids == [first] and stopped.stop_reason == "stop"


@pytest.mark.parametrize("chain", [False, True], ids=["serial", "chained"])
def test_stop_strings(tiny_dir, tiny_tokenizer, chain):
    cfg = tiny_qwen3_config(vocab_size=len(tiny_tokenizer) + 8 - len(tiny_tokenizer) % 8)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
    prompt = tuple(tiny_tokenizer.encode("abc"))
    engine = _engine(model, tokenizer=tiny_tokenizer, chain_windows=chain)
    free = engine.generate_sync(_requests([prompt], greedy=True, max_new_tokens=12, ignore_eos=True))[0]
    stop = fresh_stop_string(tiny_tokenizer.decode(free.output_ids))
    cut = engine.generate_sync(_requests([prompt], greedy=True, max_new_tokens=12, stop=(stop,)))[0]
    assert cut.stop_reason == "stop"
    assert cut.output_ids == free.output_ids[: len(cut.output_ids)]
    assert tiny_tokenizer.decode(cut.output_ids).endswith(stop)


def test_sleep_and_wake_keep_requests_and_weights():
    model = _model("qwen3")
    prompts = _prompts(3)
    engine = _engine(copy.deepcopy(model))
    state = {k: v.clone() for k, v in model.state_dict().items()}

    async def run():
        await engine.sleep(weights=True)
        assert not engine.core.cache.allocated
        assert all(p.numel() == 0 for p in engine.model.parameters())
        assert engine.paged._fused == []  # the fused projections went with the weights
        await engine.wake()
        with pytest.raises(RuntimeError, match="call update_weights"):
            async for _ in engine.generate(_requests(prompts, max_new_tokens=2)):
                pass
        await engine.update_weights(state.items(), version=4)
        return await engine.generate_all(_requests(prompts, greedy=True, max_new_tokens=5, ignore_eos=True))

    results = asyncio.run(run())
    for p, r in zip(prompts, results):
        assert r.output_ids == reference_greedy(model, p, 5, set())
        assert r.output_versions == [4] * 5


def _assert_views(linears, fused, attr="weight"):
    offset = 0
    for lin in linears:
        t = getattr(lin, attr)
        assert t.data_ptr() == fused.data_ptr() + offset * fused.element_size()
        torch.testing.assert_close(fused.flatten()[offset : offset + t.numel()].view_as(t), t, rtol=0, atol=0)
        offset += t.numel()
    assert offset == fused.numel()


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_projections_are_views_of_one_fused_tensor_and_updates_land_there(kind):
    model = _model(kind)
    engine = _engine(copy.deepcopy(model))
    fused = engine.paged.fused_weights()
    epoch = engine.paged.weights_epoch
    for layer, f in zip(engine.model.model.layers, fused):
        a, mlp = layer.self_attn, layer.mlp
        _assert_views([a.q_proj, a.k_proj, a.v_proj], f.qkv)
        _assert_views([mlp.gate_proj, mlp.up_proj], f.gate_up)
        if kind == "qwen2":
            _assert_views([a.q_proj, a.k_proj, a.v_proj], f.qkv_bias, "bias")
        else:
            assert f.qkv_bias is None
    # an update by name lands in the fused tensors (no new buffers, graphs need no new capture)
    torch.manual_seed(5)
    new = {name: torch.randn_like(t) * 0.1 for name, t in engine.named_parameters().items()}
    engine.load_weights(new.items(), version=1)
    assert engine.paged.fused_weights() is fused and engine.paged.weights_epoch == epoch
    prefix = "model.layers.0."
    want = torch.cat([new[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(fused[0].qkv, want, rtol=0, atol=0)
    want = torch.cat([new[prefix + f"mlp.{p}_proj.weight"] for p in ("gate", "up")])
    torch.testing.assert_close(fused[0].gate_up, want, rtol=0, atol=0)
    # a parameter given new storage is fused again, its value kept, and the epoch says so
    k = engine.model.model.layers[1].self_attn.k_proj
    k.weight.data = k.weight.data.clone() + 1
    value = k.weight.detach().clone()
    again = engine.paged.fused_weights()
    assert engine.paged.weights_epoch == epoch + 1
    _assert_views([engine.model.model.layers[1].self_attn.q_proj, k, engine.model.model.layers[1].self_attn.v_proj],
                  again[1].qkv)  # fmt: skip
    torch.testing.assert_close(k.weight, value, rtol=0, atol=0)
    # and generation runs on the new weights: greedy equals the reference loop of the same state
    reference = copy.deepcopy(model)
    state = {**new, "model.layers.1.self_attn.k_proj.weight": value}
    reference.load_state_dict(state, strict=False)
    prompts = _prompts(3)
    results = engine.generate_sync(_requests(prompts, greedy=True, max_new_tokens=6, ignore_eos=True))
    for p, r in zip(prompts, results):
        assert r.output_ids == reference_greedy(reference, p, 6, set())


def _rope_store_reference(
    qkv, positions, cos, sin, qn_w, kn_w, eps, k_cache, v_cache, slots, nh, nkv, **launch
):
    """`triton_qkv.rope_store` in plain torch: per-head RMSNorm of q and k (Qwen3), rotary
    embedding, k and v into the cache slots; returns q `[N, nh, D]`."""
    d = cos.shape[-1]
    n = qkv.shape[0]
    q, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
    q, k, v = q.reshape(n, nh, d), k.reshape(n, nkv, d), v.reshape(n, nkv, d)

    def rms(x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def rotate(x):
        c, s_ = cos[positions][:, None], sin[positions][:, None]
        return x * c + torch.cat((-x[..., d // 2 :], x[..., : d // 2]), dim=-1) * s_

    if qn_w is not None:
        q, k = rms(q, qn_w), rms(k, kn_w)
    q, k = rotate(q), rotate(k)
    k_cache.view(-1, nkv, d)[slots] = k
    v_cache.view(-1, nkv, d)[slots] = v
    return q


def _swiglu_reference(gu):
    g, u = gu.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


@pytest.mark.parametrize("projections", ["cublas", "split_k"])
@pytest.mark.parametrize("swiglu_kernel", [False, True], ids=["compiled_swiglu", "swiglu_kernel"])
def test_the_fused_decode_layer_adds_each_residual_once(monkeypatch, projections, swiglu_kernel):
    """The fused decode layer's own arithmetic on the CPU (fp32), its kernels replaced by plain
    torch: projections whose residual is added by the split-K kernel, or left to the RMSNorm after
    them (`_add_rms`, as cuBLAS's rows are), give the greedy tokens and log-probs of the standard
    layers; with `SwigluOptions.in_decode` the SwiGLU is the kernel's, once a layer."""
    import sys
    import types

    def linear(x, w, residual=None, config=None, bias=None):
        y = x @ w.t() + (0 if bias is None else bias)
        return y if residual is None else residual + y

    calls = {"add_rms": 0, "swiglu": 0}

    def counted_swiglu(gu, **launch):
        calls["swiglu"] += 1
        return _swiglu_reference(gu)

    split_k = projections == "split_k"
    if split_k:
        monkeypatch.setattr("laden.rollout.native.model.SPLIT_K_DTYPES", (torch.float32,))
    fakes = {
        "laden.rollout.native.kernels.triton_linear": {"pick_config": lambda *a, **k: object() if split_k else None,
                                               "linear": linear},
        "laden.rollout.native.kernels.triton_qkv": {"rope_store": _rope_store_reference},
        "laden.rollout.native.kernels.triton_swiglu": {"swiglu": counted_swiglu},
    }  # fmt: skip
    for name, attrs in fakes.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    model = _model("qwen3")
    prompts = _prompts(4)
    reqs = _requests(prompts, greedy=True, max_new_tokens=9, ignore_eos=True)
    plain = _engine(copy.deepcopy(model)).generate_sync(reqs)
    options = KernelOptions(swiglu=SwigluOptions(in_decode=swiglu_kernel))
    engine = _engine(copy.deepcopy(model), kernel_options=options)
    engine.paged.fused_decode = True  # as on a GPU with Triton (the CPU engine never picks it)
    engine.paged._num_sms = 2
    add_rms = engine.paged._add_rms

    def counted(*args):
        calls["add_rms"] += 1
        return add_rms(*args)

    engine.paged._add_rms = counted
    fused = engine.generate_sync(reqs)
    assert engine.paged.fused_decode
    for p, a, b in zip(prompts, fused, plain):
        assert a.output_ids == b.output_ids == reference_greedy(model, p, 9, set())
        torch.testing.assert_close(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs))
    layers = model.config.num_hidden_layers
    steps = engine.core.stats["decode_steps"]
    # cuBLAS: two sums a layer in the RMSNorms but the first layer's input; split-K: none
    assert calls["add_rms"] == (0 if split_k else (2 * layers - 1) * steps), calls
    assert calls["swiglu"] == (layers * steps if swiglu_kernel else 0), calls


def test_a_triton_kernel_that_does_not_build_falls_back_to_the_torch_paths(monkeypatch, caplog):
    """A GPU or Triton version on which laden's kernels do not compile (Triton's own errors, e.g.
    out of shared memory): the decode layer and the sampler fall back to the compiled layers and
    the torch sampler, once, and generation equals the reference. Simulated on the CPU with the
    kernel modules replaced by ones whose kernels raise such an error."""
    import sys
    import types

    error = type("OutOfResources", (RuntimeError,), {"__module__": "triton.runtime.errors"})
    calls = {"rope_store": 0, "sample_fused": 0}

    def failing(name):
        def fn(*args, **kwargs):
            calls[name] += 1
            raise error("out of resource: shared memory, Required: 262144, Hardware limit: 101376")

        return fn

    fakes = {
        "laden.rollout.native.kernels.triton_linear": {"pick_config": lambda *a, **k: None, "linear": None},
        "laden.rollout.native.kernels.triton_qkv": {"rope_store": failing("rope_store")},
        "laden.rollout.native.kernels.triton_sampler": {"sample_fused": failing("sample_fused")},
        "laden.rollout.native.kernels.triton_swiglu": {"swiglu": None},
    }
    for name, attrs in fakes.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    model = _model("qwen3")
    engine = _engine(copy.deepcopy(model))
    engine.paged.fused_decode = True  # as on a GPU with Triton (the CPU engine never picks it)
    engine.core.runner.fused_sampler = True
    engine.core.runner.sample_seed = torch.zeros(1, dtype=torch.int64)
    engine.core.runner.sample_offset = torch.zeros(1, dtype=torch.int64)
    prompts = _prompts(4)
    with caplog.at_level("WARNING"):
        results = engine.generate_sync(_requests(prompts, greedy=True, max_new_tokens=9, ignore_eos=True))
    for p, r in zip(prompts, results):
        assert r.output_ids == reference_greedy(model, p, 9, set())
    assert calls == {"rope_store": 1, "sample_fused": 1}  # tried once each, then the torch paths
    assert not engine.paged.fused_decode and not engine.core.runner.fused_sampler
    assert "fused decode layer does not build on this GPU (OutOfResources" in caplog.text
    assert "fused sampler does not build" in caplog.text
    # any other error is not swallowed
    engine.paged.fused_decode = True
    monkeypatch.setattr(sys.modules["laden.rollout.native.kernels.triton_qkv"], "rope_store", None)
    with pytest.raises(TypeError):
        engine.generate_sync(_requests(prompts[:1], greedy=True, max_new_tokens=2, ignore_eos=True))


def test_fused_decode_asked_for_where_it_cannot_run_is_refused():
    with pytest.raises(ValueError, match="fused_decode needs CUDA.*device cpu.*leave fused_decode unset"):
        _engine(_model("qwen3"), fused_decode=True)


def test_bad_requests_are_named():
    with pytest.raises(ValueError, match="temperature=0.0 must be > 0"):
        SamplingParams(temperature=0.0)
    with pytest.raises(ValueError, match="empty prompt"):
        GenerationRequest(rid="x", input_ids=())
    engine = _engine(_model("qwen3"), max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate_sync([GenerationRequest(rid="x", input_ids=tuple(range(4, 24)))])
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.generate_sync(
            [GenerationRequest(rid="y", input_ids=(5, 6), sampling=SamplingParams(stop=("a",)))]
        )


def test_a_sequence_longer_than_the_cache_ends_with_length():
    model = _model("qwen3")
    prompt = _prompts(1)[0]
    engine = _engine(model, kv_cache_tokens=32, block_size=8)
    (r,) = engine.generate_sync(_requests([prompt], greedy=True, max_new_tokens=60, ignore_eos=True))
    assert r.stop_reason == "length" and 0 < len(r.output_ids) < 60
    assert r.output_ids == reference_greedy(model, prompt, len(r.output_ids), set())
    assert engine.core.cache.allocator.used() == 0


def test_more_samples_than_concurrency_is_refused_and_nothing_leaks():
    engine = _engine(_model("qwen3"), max_concurrent=2)
    good = GenerationRequest(rid="ok", input_ids=(5, 6, 7), sampling=SamplingParams(max_new_tokens=2))
    bad = GenerationRequest(
        rid="big", input_ids=(5, 6), sampling=SamplingParams(max_new_tokens=2), n_samples=3
    )
    with pytest.raises(ValueError, match="n_samples=3.*max_concurrent=2"):
        engine.generate_sync([good, bad])
    assert engine.core.idle and not engine._queues  # the good request was not queued either
    (r,) = engine.generate_sync([good])
    assert len(r.output_ids) == 2


@pytest.mark.parametrize("chain", [False, True], ids=["serial", "chained"])
def test_a_failing_window_aborts_what_is_pending_and_the_engine_recovers(chain):
    model = _model("qwen3")
    engine = _engine(model, max_concurrent=4, chain_windows=chain)
    calls = []

    def hook(phase, batch):
        calls.append(phase)
        if len(calls) == 2:
            raise RuntimeError("kernel failed (injected)")

    engine.core.oom_hook = hook
    with pytest.raises(RuntimeError, match="injected"):
        engine.generate_sync(_requests(_prompts(3), greedy=True, max_new_tokens=6, ignore_eos=True))
    assert engine.core.idle and engine.core.cache.allocator.used() == 0  # no block leaked
    engine.core.oom_hook = None
    prompts = _prompts(2)
    results = engine.generate_sync(_requests(prompts, greedy=True, max_new_tokens=6, ignore_eos=True))
    assert [r.output_ids for r in results] == [reference_greedy(model, p, 6, set()) for p in prompts]


def test_an_oom_on_a_group_larger_than_the_lowered_concurrency_splits_it():
    model = _model("qwen3")
    prompt = _prompts(1)[0]
    engine = _engine(model, max_concurrent=4)
    failures = []

    def hook(phase, batch):
        if phase == "prefill" and len(failures) < 1:
            failures.append(batch)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    engine.core.oom_hook = hook
    out = engine.generate_sync(
        _requests([prompt], greedy=True, max_new_tokens=5, n_samples=4, ignore_eos=True)
    )
    assert failures == [1] and engine.core.max_concurrent == 2
    assert [r.output_ids for r in out] == [reference_greedy(model, prompt, 5, set())] * 4


def test_sampling_state_continues_the_draws():
    """`sampling_state` / `load_sampling_state`: an engine given another's state samples what that
    one samples next (the torch generator), and the fused sampler's device step counter is restored
    in place (the CUDA graphs hold that tensor)."""
    model = _model("qwen3")
    a, b = _engine(copy.deepcopy(model), seed=3), _engine(copy.deepcopy(model), seed=4)
    for engine in (a, b):  # as on a GPU: the fused sampler's step counter
        engine.core.runner.sample_offset = torch.zeros(1, dtype=torch.int64)
    prompts = _prompts(3)
    a.generate_sync(_requests(prompts, max_new_tokens=5, ignore_eos=True))
    a.core.runner.sample_offset.fill_(41)
    state = a.sampling_state()
    assert state["fused_step"] == 41
    held = b.core.runner.sample_offset
    b.load_sampling_state(state)
    assert b.core.runner.sample_offset is held and int(held) == 41
    ra = a.generate_sync(_requests(prompts, max_new_tokens=6, ignore_eos=True))
    rb = b.generate_sync(_requests(prompts, max_new_tokens=6, ignore_eos=True))
    assert [r.output_ids for r in ra] == [r.output_ids for r in rb]
    c = _engine(copy.deepcopy(model), seed=5)  # a bare generator state, as older checkpoints hold
    c.load_sampling_state(a.sampling_state()["generator"])
    again = [r.output_ids for r in a.generate_sync(_requests(prompts, max_new_tokens=6, ignore_eos=True))]
    assert [
        r.output_ids for r in c.generate_sync(_requests(prompts, max_new_tokens=6, ignore_eos=True))
    ] == again
