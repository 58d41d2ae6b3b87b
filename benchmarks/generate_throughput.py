"""Generation throughput: laden's native engine against transformers' own generation paths.

One JSON line per result (workload, system, batch, output tokens/s, seconds, peak GPU GiB, ...).

    python benchmarks/generate_throughput.py --workload A --batch 64 256 --systems native hf_static hf_cb
    python benchmarks/generate_throughput.py --workload B --systems native
    python benchmarks/generate_throughput.py --greedy-check DIR --prompts 20   # a real model: same text as HF
    python benchmarks/generate_throughput.py --smoke                           # CPU, tiny model
    torchrun --nproc-per-node 2 benchmarks/generate_throughput.py --tp 2       # native:d1t2, rank 0 prints

Workload A (BENCHMARKS.md): Qwen3-0.6B shape, random init, bf16, prompts of 128 random tokens,
exactly 256 new tokens each (sampling at temperature 1, no early stop), one batch of `--batch`
requests. Workload B (nano-vllm's benchmark): 256 requests, prompt and output lengths uniform in
[100, 1024] (seeded), end-of-sequence ignored. The native engine returns every token's
log-probability in both (it always does); transformers' paths return none.

Each system runs a warm-up pass (CUDA graphs, Triton and cuBLAS choices, allocator growth)
before the timed one, after a reset of torch.compile's caches (as in a fresh process); the timed
pass is one `generate` call over all requests, synchronised at both ends. `--tp N` (under
torchrun with N processes): the native engine tensor parallel over the N ranks (`native:d1tN`),
the model sharded on the host before it moves to each GPU; only rank 0 prints.
`--greedy-check`: greedy completions of `--prompts` chat prompts from a model directory (fp32,
TF32 off) by the native engine and by `model.generate`, compared token by token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import QWEN3_SHAPES, device_idle, git_commit  # noqa: E402

from laden.rollout.native.kernels.options import KernelOptions  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=True)  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_gib(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def build_model(shape: dict[str, Any], device: torch.device, dtype: torch.dtype, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(
        **shape, max_position_embeddings=4096, eos_token_id=None, bos_token_id=None, pad_token_id=0
    )
    cfg._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    return model.to(device).eval()


def workload(name: str, batch: int, vocab: int, smoke: bool) -> list[tuple[list[int], int]]:
    """(prompt ids, new tokens) per request."""
    g = torch.Generator().manual_seed(1234)
    if name == "A":
        p, n = (16, 24) if smoke else (128, 256)
        return [(torch.randint(10, vocab, (p,), generator=g).tolist(), n) for _ in range(batch)]
    lo, hi = (8, 40) if smoke else (100, 1024)
    out = []
    for _ in range(batch):
        p = int(torch.randint(lo, hi + 1, (1,), generator=g))
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        out.append((torch.randint(10, vocab, (p,), generator=g).tolist(), n))
    return out


def run_native(model, reqs, args, device) -> dict[str, Any]:
    from laden.rollout import GenerationRequest, SamplingParams
    from laden.rollout.native import NativeEngine

    max_len = max(len(p) + n for p, n in reqs)
    t0 = time.perf_counter()
    engine = NativeEngine(
        model, max_concurrent=len(reqs), max_model_len=max_len + 8, mem_fraction_static=args.mem_fraction,
        decode_steps=args.decode_steps, cuda_graphs=None if not args.no_graphs else False,
        decode_backend=args.decode_backend, seed=0, tensor_parallel=args.tensor_parallel,
        chain_windows=False if args.no_chain else None, fused_decode=False if args.no_fused else None,
        max_prefill_tokens=args.max_prefill_tokens, kernel_options=args.engine_kernel_options,
    )  # fmt: skip
    build_s = time.perf_counter() - t0

    def requests(tag: str):
        return [
            GenerationRequest(
                rid=f"{tag}{i}",
                input_ids=tuple(p),
                sampling=SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True),
            )  # fmt: skip
            for i, (p, n) in enumerate(reqs)
        ]

    warm = [(p, min(n, 16)) for p, n in reqs]
    engine.generate_sync(
        [
            GenerationRequest(
                rid=f"w{i}", input_ids=tuple(p), sampling=SamplingParams(max_new_tokens=n, ignore_eos=True)
            )
            for i, (p, n) in enumerate(warm)
        ]
    )
    for k in engine.core.stats:
        engine.core.stats[k] = 0
    _sync(device)
    prof = None
    if args.profile and device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        prof.__enter__()
    t0 = time.perf_counter()
    results = engine.generate_sync(requests("t"))
    _sync(device)
    seconds = time.perf_counter() - t0
    if prof is not None:
        prof.__exit__(None, None, None)
        events = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
        top = sorted(events, key=lambda e: -e.self_device_time_total)[: args.profile_top]
        print(json.dumps({"profile": "native", "batch": len(reqs),
            "device_s": round(sum(e.self_device_time_total for e in events) / 1e6, 4),
            "kernel_calls": sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
            "kernels": [
            {"name": e.key[:90], "self_device_s": round(e.self_device_time_total / 1e6, 4), "calls": e.count}
            for e in top], "idle": device_idle(prof)}), flush=True)  # fmt: skip
    engine.shutdown()
    out_tokens = sum(len(r.output_ids) for r in results)
    assert all(len(r.output_logprobs) == len(r.output_ids) for r in results)
    return {
        "output_tokens": out_tokens, "seconds": round(seconds, 3), "build_s": round(build_s, 2),
        "kv_blocks": engine.core.cache.num_blocks - 1, "block_size": engine.block_size,
        "kv_gib": round(engine.core.cache.nbytes / 2**30, 2), "decode_backend": engine.paged.decode_backend,
        "cuda_graphs": engine.cuda_graphs, "chain_windows": engine.core.chain_windows,
        "fused_decode": engine.paged.fused_decode,
        "decode_steps": engine.decode_steps, "max_prefill_tokens": engine.max_prefill_tokens, "stats": dict(engine.core.stats),
        "logprobs": True,
    }  # fmt: skip


def run_hf_static(model, reqs, args, device) -> dict[str, Any]:
    from transformers import GenerationConfig

    n = reqs[0][1]
    ids = torch.tensor([p for p, _ in reqs], device=device)
    static = args.hf_cache == "static" and device.type == "cuda"
    gc = GenerationConfig(
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        pad_token_id=0,
        # transformers compiles the decode step itself over a static cache (its fastest path)
        **({"cache_implementation": "static"} if static else {}),
    )
    with torch.no_grad():
        # warm-up: a static cache is sized by prompt + new tokens, so the compiled step is only
        # reused by a pass of the same length; a dynamic cache needs a few steps only
        short = {} if static else {"max_new_tokens": 8, "min_new_tokens": 8}
        model.generate(ids, generation_config=GenerationConfig(**{**gc.to_dict(), **short}),
                       attention_mask=torch.ones_like(ids))  # fmt: skip
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, generation_config=gc, attention_mask=torch.ones_like(ids))
        _sync(device)
    seconds = time.perf_counter() - t0
    return {
        "output_tokens": int((out.shape[1] - ids.shape[1]) * ids.shape[0]),
        "seconds": round(seconds, 3),
        "logprobs": False,
        "cache": "static" if static else "dynamic",
    }


def run_hf_cb(model, reqs, args, device) -> dict[str, Any]:
    from transformers import GenerationConfig

    n = reqs[0][1]
    gc = GenerationConfig(
        max_new_tokens=n, min_new_tokens=n, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0,
        eos_token_id=None, max_batch_tokens=args.hf_cb_batch_tokens,
    )  # fmt: skip
    inputs = [p for p, _ in reqs]
    errors = []
    for impl in ("paged|sdpa", "sdpa", "paged|eager"):  # transformers versions accept different ones
        model.config._attn_implementation = impl
        try:
            with torch.no_grad():
                model.generate_batch(inputs=inputs[:8], generation_config=gc)
            break
        except ValueError as e:
            errors.append(f"{impl}: {e}")
    else:
        raise RuntimeError("; ".join(errors))
    _sync(device)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate_batch(inputs=inputs, generation_config=gc)
        _sync(device)
    seconds = time.perf_counter() - t0
    tokens = sum(len(v.generated_tokens) for v in out.values())
    return {"output_tokens": int(tokens), "seconds": round(seconds, 3), "logprobs": False,
            "attn_implementation": model.config._attn_implementation}  # fmt: skip


SYSTEMS = {"native": run_native, "hf_static": run_hf_static, "hf_cb": run_hf_cb}


def greedy_check(args, device) -> None:
    """Native greedy == transformers greedy, token by token, on a real model (fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from laden.rollout import GenerationRequest, SamplingParams
    from laden.rollout.native import NativeEngine

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tok = AutoTokenizer.from_pretrained(args.greedy_check)
    model = (
        AutoModelForCausalLM.from_pretrained(args.greedy_check, torch_dtype=torch.float32).to(device).eval()
    )
    questions = [f"What is {a} + {b}?" for a, b in zip(range(11, 31), range(25, 85, 3))][: args.prompts]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in questions
    ]
    prompts = [
        list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts
    ]
    n = args.greedy_tokens
    engine = NativeEngine(
        model,
        tok,
        max_concurrent=len(prompts),
        max_model_len=max(map(len, prompts)) + n + 8,
        kv_cache_tokens=65536,
        kernel_options=args.engine_kernel_options,
    )
    got = engine.generate_sync(
        [
            GenerationRequest(
                rid=str(i), input_ids=tuple(p), sampling=SamplingParams(greedy=True, max_new_tokens=n)
            )
            for i, p in enumerate(prompts)
        ]
    )
    same = 0
    for i, (p, r) in enumerate(zip(prompts, got)):
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([p], device=device), max_new_tokens=n, do_sample=False,
                eos_token_id=list(engine.core.eos_token_ids) or None, pad_token_id=tok.pad_token_id,
            )[0, len(p):].tolist()  # fmt: skip
        eos = set(engine.core.eos_token_ids)
        cut = next((j + 1 for j, t in enumerate(ref) if t in eos), len(ref))
        ref = ref[:cut]
        ok = ref == r.output_ids
        same += ok
        first_diff = next((j for j, (a, b) in enumerate(zip(ref, r.output_ids)) if a != b), None)
        print(json.dumps({"check": "greedy", "prompt": questions[i], "equal": ok, "native": tok.decode(r.output_ids),
                          "hf": tok.decode(ref), "first_diff": first_diff}))  # fmt: skip
    print(json.dumps({"check": "greedy_summary", "model": str(args.greedy_check), "prompts": len(prompts), "equal": same,
                      "device": str(device), "git_commit": git_commit()}))  # fmt: skip


def _start_tensor_parallel(args, device: torch.device) -> tuple[torch.device, bool]:
    """torchrun's processes as one native engine of `args.tp` ranks; (this rank's device, rank 0?)."""
    from laden.engine.parallel.launch import init_distributed
    from laden.rollout.native.tensor_parallel import tensor_parallel_groups

    if args.systems != ["native"] or args.greedy_check is not None:
        raise SystemExit("--tp runs the native system only (no --greedy-check)")
    backend = "gloo" if device.type == "cpu" else None
    rank, world, _, local = init_distributed(backend)
    if world != args.tp:
        raise SystemExit(f"--tp {args.tp} needs torchrun --nproc-per-node {args.tp} (this run has {world})")
    args.tensor_parallel = tensor_parallel_groups(args.tp)
    return (local if device.type == "cuda" else device), rank == 0


def _build(shape: dict[str, Any], device: torch.device, dtype: torch.dtype, tp):
    """`build_model`; under tensor parallel built on the host and sharded before it moves to the GPU."""
    if tp is None:
        return build_model(shape, device, dtype)
    from laden.rollout.native.tensor_parallel import ShardLayout

    model = build_model(shape, torch.device("cpu"), dtype)
    ShardLayout(model.config, rank=tp.rank, size=tp.size).shard_model(model)
    return model.to(device)


def kernel_options_from(options: list[str]) -> tuple[KernelOptions, dict[str, Any]]:
    """`MODULE.NAME=VALUE` words (a Python literal, or a bare word as a string) as the engine's
    `KernelOptions`, and the settings as given (recorded as `kernel_options`); only settings
    `KernelOptions` has, so a typo is an error, not an option that does nothing."""
    import ast

    value_of = KernelOptions()
    done: dict[str, Any] = {}
    for option in options:
        target, sep, text = option.partition("=")
        if not sep or "." not in target:
            raise SystemExit(
                f"--kernel-option {option!r}: expected MODULE.NAME=VALUE, e.g. triton_swiglu.IN_DECODE=True"
            )
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text  # a bare word: a string (triton_sampler.METHOD=cdf)
        try:
            value_of = value_of.with_setting(target, value)
        except ValueError as e:
            raise SystemExit(f"--kernel-option {option!r}: {e}") from e
        done[target] = value
    return value_of, done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["A", "B"], default="A")
    ap.add_argument("--batch", type=int, nargs="+", default=None, help="A: 64 256; B: 256")
    ap.add_argument("--systems", nargs="+", default=["native"], choices=sorted(SYSTEMS))
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(QWEN3_SHAPES))
    ap.add_argument("--mem-fraction", type=float, default=0.8)
    ap.add_argument("--decode-steps", type=int, default=None)
    ap.add_argument(
        "--max-prefill-tokens", type=int, default=None, help="native: tokens one prefill may take"
    )
    ap.add_argument("--decode-backend", default="auto")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument(
        "--no-chain", action="store_true", help="native: read each window before launching the next"
    )
    ap.add_argument("--hf-cb-batch-tokens", type=int, default=None)
    ap.add_argument("--hf-cache", choices=["static", "dynamic"], default="static",
                    help="hf_static's KV cache on CUDA: static (transformers compiles its step) or dynamic")  # fmt: skip
    ap.add_argument("--profile", action="store_true", help="native: top CUDA kernels of the timed pass")
    ap.add_argument(
        "--no-fused", action="store_true", help="native: decode through the compiled layers and cuBLAS"
    )
    ap.add_argument("--profile-top", type=int, default=15, help="--profile: how many kernels to list")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, short sequences")
    ap.add_argument(
        "--greedy-check", type=Path, default=None, help="model directory: native greedy == HF greedy"
    )
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--greedy-tokens", type=int, default=64)
    ap.add_argument("--tp", type=int, default=1, help="native tensor parallel size (run under torchrun)")
    ap.add_argument(
        "--kernel-option", nargs="*", default=[], metavar="MODULE.NAME=VALUE",
        help="native: a setting of the engine's KernelOptions (laden.rollout.native.kernels.options), e.g. "
        "triton_swiglu.IN_DECODE=True or triton_decode.PREFETCH_TABLE=True (recorded as kernel_options)",
    )  # fmt: skip
    args = ap.parse_args()
    args.engine_kernel_options, args.kernel_options = kernel_options_from(args.kernel_option)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    args.tensor_parallel, is_main = None, True
    if args.tp > 1:
        device, is_main = _start_tensor_parallel(args, device)
    if args.greedy_check is not None:
        greedy_check(args, device)
        return
    shape = TINY if args.smoke else QWEN3_SHAPES[args.shape]
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    batches = args.batch or ([64, 256] if args.workload == "A" else [256])
    if args.smoke:
        batches = [min(b, 8) for b in batches]
    for batch in batches:
        reqs = workload(args.workload, batch, shape["vocab_size"], args.smoke)
        for system in args.systems:
            # each result compiles as in a process of its own: the systems share no compiled frames,
            # and a batch size run after another is not recompiled with a dynamic batch dimension
            torch._dynamo.reset()
            started = time.perf_counter()
            model = _build(shape, device, dtype, args.tensor_parallel)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            record: dict[str, Any] = {
                "bench": "generate_throughput", "workload": args.workload, "system": system, "batch": batch,
                "shape": "tiny" if args.smoke else args.shape, "dtype": str(dtype).removeprefix("torch."),
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "prompt_tokens": sum(len(p) for p, _ in reqs), "git_commit": git_commit(), "tp": args.tp,
            }  # fmt: skip
            if args.kernel_options and system == "native":
                record["kernel_options"] = args.kernel_options
            try:
                record.update(SYSTEMS[system](model, reqs, args, device))
                record["output_tokens_per_s"] = round(record["output_tokens"] / record["seconds"], 1)
            except Exception as e:  # noqa: BLE001 - one system's failure is a result line, not the end
                record.update(error=f"{type(e).__name__}: {e}"[:500])
            record["peak_gpu_gib"] = _peak_gib(device)
            record["wall_s"] = round(time.perf_counter() - started, 1)  # build, compile, warm-up, timed pass
            if is_main:
                print(json.dumps(record), flush=True)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
