"""The native engine's GPU paths: the Triton paged decode kernel, CUDA graphs, bf16 generation.

The kernel is also checked on the CPU through Triton's interpreter when Triton is installed
(`TRITON_INTERPRET=1`, in a subprocess: the variable is read at import)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from interpreted import interpret, interpret_ok
from native_cases import (
    EOS,
    KERNEL_OPTIONS,
    _model,
    _prompts,
    _requests,
    reference_greedy,
    teacher_forced_logprobs,
)
from paged_case import paged_case

from laden.rollout.native.attention import decode_attention_torch, triton_available

gpu = pytest.mark.gpu


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
def test_triton_kernel_in_the_interpreter():
    code = textwrap.dedent(
        """
        import torch
        from laden.rollout.native.kernels.triton_decode import paged_decode
        from laden.rollout.native.attention import decode_attention_torch
        from paged_case import paged_case
        q, kc, vc, table, lens = paged_case(3, 4, 2, 16, 8, [40, 5, 77], torch.float32, "cpu")
        ref = decode_attention_torch(q, kc, vc, table, lens, 0.25)
        # one split, splits of 1 to 3 pages, tiles of 1, 2 and 4 pages (partial tiles at a split's end)
        for split_pages in (None, 1, 2, 3):
            for tile in (8, 16, 32):
                variants = ((False, False, 1), (True, False, 1), (True, True, 1), (True, False, 2), (False, True, 2))
                for heads_inner, prefetch, pair in variants:
                    out = paged_decode(
                        q, kc, vc, table, lens, 0.25, split_pages, tile_tokens=tile, heads_inner=heads_inner,
                        prefetch_table=prefetch, heads_per_program=pair,
                    )
                    err = (out - ref).abs().max()
                    assert err < 1e-5, (split_pages, tile, heads_inner, prefetch, pair, err)
        # every slot no row uses (past each row's end, the sink, free blocks) holds NaN: the
        # masked loads never read them; reading them and masking the scores lets NaN through p @ v
        used = torch.zeros(kc.shape[:2], dtype=torch.bool)
        for i, n in enumerate(lens.tolist()):
            for t in range(n):
                used[table[i, t // 8], t % 8] = True
        kc[~used], vc[~used] = float("nan"), float("nan")
        for split_pages in (None, 2):
            out = paged_decode(q, kc, vc, table, lens, 0.25, split_pages, tile_tokens=32, mask_loads=True)
            assert (out - ref).abs().max() < 1e-5, split_pages
        paired = paged_decode(q, kc, vc, table, lens, 0.25, tile_tokens=16, mask_loads=True, heads_per_program=2)
        assert (paired - ref).abs().max() < 1e-5
        unmasked = paged_decode(q, kc, vc, table, lens, 0.25, tile_tokens=32, mask_loads=False)
        assert unmasked.isnan().any()
        print("ok")
        """
    )
    interpret_ok(code)


FUSED_IN_THE_INTERPRETER = """
import copy, torch
from test_native_engine import _engine, _model, _prompts, _requests, reference_greedy, teacher_forced_logprobs
import laden.rollout.native.model as native_model
from laden.rollout.native.kernels.options import KernelOptions

native_model.SPLIT_K_DTYPES = (torch.float32,)  # the split-K linear in fp32 too
model = _model("qwen3")
prompts = _prompts(3)
want = [reference_greedy(model, p, 4, set()) for p in prompts]
options = [{}, {"triton_swiglu.IN_DECODE": True}, {"triton_decode.HEADS_PER_PROGRAM": 2},
           {"triton_decode.PREFETCH_TABLE": True}, {"triton_sampler.METHOD": "cdf"}]
options.append({key: value for opt in options for key, value in opt.items()})  # all of them together
options = [options[0], options[-1]] if WHICH == "defaults_and_all" else options[1:-1]
for opt in options:
    kernel_options = KernelOptions()
    for target, value in opt.items():
        kernel_options = kernel_options.with_setting(target, value)
    engine = _engine(copy.deepcopy(model), kv_cache_tokens=512, kernel_options=kernel_options)
    paged = engine.paged
    paged.fused_decode, paged._num_sms, paged.decode_backend = True, 1000, "triton"  # every projection split-K
    engine.core.runner.fused_sampler = True
    engine.core.runner.sample_seed = torch.zeros(1, dtype=torch.int64)
    engine.core.runner.sample_offset = torch.zeros(1, dtype=torch.int64)
    got = engine.generate_sync(_requests(prompts, greedy=True, max_new_tokens=4, ignore_eos=True))
    assert [r.output_ids for r in got] == want, (opt, [r.output_ids for r in got], want)
    sampled = engine.generate_sync(_requests(prompts, temperature=1.0, max_new_tokens=4, ignore_eos=True))
    for p, r in zip(prompts, sampled):
        ref = teacher_forced_logprobs(model, p, r.output_ids, 1.0)
        assert torch.allclose(torch.tensor(r.output_logprobs), ref, atol=1e-4), (opt, r.output_logprobs, ref)
    assert paged.fused_decode and engine.core.runner.fused_sampler
print("ok")
"""


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
@pytest.mark.parametrize(
    "which",
    # slow: each option alone. In the default tier every option's kernel runs here with the others
    # (all together), and alone at the kernel level: test_triton_kernel_in_the_interpreter (heads per
    # program, prefetched table), tests/rollout/test_triton_swiglu.py, tests/rollout/test_triton_sampler.py (cdf)
    ["defaults_and_all", pytest.param("each_alone", marks=pytest.mark.slow)],
)
def test_the_fused_decode_layer_with_every_kernel_option_in_the_interpreter(which):
    """The whole fused decode path on the CPU in fp32 under Triton's interpreter, its real kernels
    (the split-K linear for every projection, `rope_store`, paged attention, the fused sampler), with
    the defaults, with each option the benchmark compares and with all of them together (the
    benchmark's pick may join them): greedy tokens equal the reference loop's, sampled tokens'
    log-probs the teacher-forced ones, and no path falls back."""
    done = interpret(f"WHICH = {which!r}\n{FUSED_IN_THE_INTERPRETER}", timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@gpu
@pytest.mark.parametrize("hq,hkv", [(16, 8), (32, 8), (4, 4)])
@pytest.mark.parametrize("split_pages,page", [(None, 16), (4, 16), (None, 32), (3, 32), (16, 32)])
def test_triton_kernel_equals_reference_bf16(hq, hkv, split_pages, page):
    lengths = [1, 15, 16, 17, 500, 2000, 33]
    q, kc, vc, table, lens = paged_case(len(lengths), hq, hkv, 128, page, lengths, torch.bfloat16, "cuda")
    from laden.rollout.native.kernels.triton_decode import paged_decode

    ref = decode_attention_torch(q.float(), kc.float(), vc.float(), table, lens, 128**-0.5)
    out = paged_decode(q, kc, vc, table, lens, 128**-0.5, split_pages)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@gpu
@pytest.mark.parametrize(
    "options",
    [{"heads_per_program": 2}, {"prefetch_table": True}, {"heads_per_program": 2, "prefetch_table": True},
     {"prefetch_table": True, "num_stages": 3}, {"max_registers": 128}, {"max_registers": 128, "tile_tokens": 64}],
)  # fmt: skip
@pytest.mark.parametrize("split_pages", [None, 4])
def test_the_kernels_untried_options_equal_the_reference_bf16(options, split_pages):
    """The options the benchmark compares (off by default until measured) compute the same attention."""
    lengths = [1, 15, 16, 17, 500, 2000, 33]
    q, kc, vc, table, lens = paged_case(len(lengths), 16, 8, 128, 32, lengths, torch.bfloat16, "cuda")
    from laden.rollout.native.kernels.triton_decode import paged_decode

    ref = decode_attention_torch(q.float(), kc.float(), vc.float(), table, lens, 128**-0.5)
    out = paged_decode(q, kc, vc, table, lens, 128**-0.5, split_pages, **options)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fp32_greedy_on_cuda_equals_reference(backend):
    from laden.rollout.native import NativeEngine

    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model("qwen3").cuda()
    prompts = _prompts(7)
    engine = NativeEngine(
        model,
        max_concurrent=8,
        max_model_len=128,
        kv_cache_tokens=4096,
        decode_backend=backend,
        cuda_graphs=True,
    )
    results = engine.generate_sync(_requests(prompts, greedy=True, max_new_tokens=16, ignore_eos=True))
    for p, r in zip(prompts, results):
        assert r.output_ids == reference_greedy(model, p, 16, set())
        ref = teacher_forced_logprobs(model, torch.tensor(p).tolist(), r.output_ids, 1.0).cpu()
        torch.testing.assert_close(torch.tensor(r.output_logprobs), ref, atol=1e-4, rtol=1e-4)


@gpu
@pytest.mark.parametrize("chain", [False, True], ids=["serial", "chained"])
def test_fp32_greedy_with_stops_through_graphs_equals_reference(chain):
    """Chained windows on CUDA (pinned copies, events): rows that stop inside a window run on
    speculatively in the next one and their extra tokens are dropped."""
    from laden.rollout.native import NativeEngine

    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model("qwen3").cuda()
    prompts = _prompts(7)
    firsts = [reference_greedy(model, p, 3, set())[2] for p in prompts]
    stop = max(set(firsts), key=firsts.count)  # a token some rows meet inside a window
    engine = NativeEngine(
        model, max_concurrent=8, max_model_len=128, kv_cache_tokens=4096, decode_backend="triton",
        cuda_graphs=True, decode_steps=3, chain_windows=chain,
    )  # fmt: skip
    results = engine.generate_sync(_requests(prompts, greedy=True, max_new_tokens=20, stop_token_ids=(stop,)))
    for p, r in zip(prompts, results):
        assert r.output_ids == reference_greedy(model, p, 20, {stop, EOS})
    assert (engine.core.stats["chained"] > 0) == chain
    assert engine.core.cache.allocator.used() == 0


@gpu
def test_cuda_graphs_equal_eager_bf16():
    from laden.rollout.native import NativeEngine

    model = _model("qwen3").cuda().to(torch.bfloat16)
    prompts = _prompts(7)
    reqs = _requests(prompts, greedy=True, max_new_tokens=24, ignore_eos=True)
    eager = NativeEngine(
        model, max_concurrent=8, max_model_len=128, kv_cache_tokens=4096, cuda_graphs=False
    ).generate_sync(reqs)
    graphed = NativeEngine(
        model, max_concurrent=8, max_model_len=128, kv_cache_tokens=4096, cuda_graphs=True
    ).generate_sync(reqs)
    assert [r.output_ids for r in graphed] == [r.output_ids for r in eager]
    # sampling with top-p through a lazily captured graph returns log-probs of the drawn tokens
    sampled = NativeEngine(
        model, max_concurrent=8, max_model_len=128, kv_cache_tokens=4096, seed=1
    ).generate_sync(_requests(prompts, temperature=0.9, top_p=0.9, max_new_tokens=12, ignore_eos=True))
    for p, r in zip(prompts, sampled):
        ref = teacher_forced_logprobs(model, p, r.output_ids, 0.9).cpu()
        torch.testing.assert_close(torch.tensor(r.output_logprobs), ref, atol=0.1, rtol=0.05)


def _wide_bf16_model(kind):
    """Two layers at the Qwen3-0.6B widths in bf16 on the GPU, seeded; initializer_range gives
    peaked distributions, whose log-probs tell a wrong path apart."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

    torch.manual_seed(0)
    widths = dict(vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
                  num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=512,
                  initializer_range=0.08)  # fmt: skip
    cfg = Qwen3Config(head_dim=128, **widths) if kind == "qwen3" else Qwen2Config(**widths)
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16).cuda().eval()


def _uneven_prompts(batch):
    return [tuple(range(5 + i, 5 + i + 3 + 11 * (i % 7))) for i in range(batch)]


@gpu
@pytest.mark.parametrize("batch", [7, 160])
@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_fused_decode_bf16_returns_the_models_logprobs(kind, batch):
    """laden's Triton layer (fused q/k norm, rotary embedding and cache writes; split-K projections
    at 7 rows, cuBLAS ones with the residual summed in the next RMSNorm at 160) at the Qwen3-0.6B
    widths, two layers: the log-probs of the greedy tokens against the model's own forward, as for
    the compiled layers' run."""
    from laden.rollout.native import NativeEngine

    model = _wide_bf16_model(kind)
    prompts = _uneven_prompts(batch)
    reqs = _requests(prompts, greedy=True, max_new_tokens=24, ignore_eos=True)
    runs = {}
    for fused in (True, False):
        engine = NativeEngine(
            model, max_concurrent=batch + 1, max_model_len=128, kv_cache_tokens=32768, fused_decode=fused
        )
        assert engine.paged.fused_decode == fused
        runs[fused] = engine.generate_sync(reqs)
        engine.shutdown()
    for fused, results in runs.items():
        for p, r in list(zip(prompts, results))[:: 1 if batch <= 8 else 8]:
            ref = teacher_forced_logprobs(model, p, r.output_ids, 1.0).cpu()
            assert ref.mean() > -4, ref  # far from uniform (-log 2048 = -7.6)
            torch.testing.assert_close(
                torch.tensor(r.output_logprobs), ref, atol=0.1, rtol=0.05, msg=str(fused)
            )


@gpu
@pytest.mark.parametrize("name", list(KERNEL_OPTIONS))
def test_kernel_options_bf16_return_the_models_logprobs(name):
    """Each option compiled for the GPU (stages, register caps, split-K above 128 rows), 160 rows
    at the Qwen3-0.6B widths: greedy and sampled tokens' log-probs against the model's forward."""
    from laden.rollout.native import NativeEngine
    from laden.rollout.native.kernels.options import KernelOptions

    kernel_options = KernelOptions()
    for target, value in KERNEL_OPTIONS[name].items():
        kernel_options = kernel_options.with_setting(target, value)
    model = _wide_bf16_model("qwen3")
    prompts = _uneven_prompts(160)
    # compile=False: the decode step is the options' kernels either way (in CUDA graphs, as benchmarked)
    engine = NativeEngine(
        model, max_concurrent=161, max_model_len=128, kv_cache_tokens=32768, compile=False,
        kernel_options=kernel_options,
    )  # fmt: skip
    greedy = engine.generate_sync(_requests(prompts, greedy=True, max_new_tokens=24, ignore_eos=True))
    sampled = engine.generate_sync(_requests(prompts, temperature=1.0, max_new_tokens=24, ignore_eos=True))
    assert engine.paged.fused_decode and engine.core.runner.fused_sampler  # no kernel fell back
    engine.shutdown()
    for results in (greedy, sampled):
        for p, r in list(zip(prompts, results))[::8]:
            ref = teacher_forced_logprobs(model, p, r.output_ids, 1.0).cpu()
            torch.testing.assert_close(torch.tensor(r.output_logprobs), ref, atol=0.1, rtol=0.05, msg=name)
    assert any(g.output_ids != s.output_ids for g, s in zip(greedy, sampled))  # the sampled run sampled
