"""Kernel timings behind the roundpipe engine's step, on the GPU: attention backends and the weight-gradient fold.

    python3 benchmarks/kernels_h200.py [--seq-len 4096] [--docs 1 2] [--iters 20]

Prints one JSON object. Attention: forward and forward+backward milliseconds of one micro-batch's
attention (Qwen3-1.7B heads: 16 query, 8 key/value, head dim 128, bf16, causal) through
`varlen_attn` (what `laden_varlen` calls) and through `scaled_dot_product_attention` with each
backend pinned, one call per document. Gradient fold: one Qwen3-1.7B MLP weight gradient
(`[6144, 2048]` from 4096 tokens) added into an fp32 accumulator, as a bf16 GEMM followed by an
add, and as one GEMM with an fp32 output that accumulates in place (`out_dtype`, where the
installed torch has it). A variant that fails to run is reported with its error, not skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # laden from this checkout


def timed(fn: Callable[[], object], iters: int) -> float:
    """Milliseconds per call, after two warm-up calls."""
    for _ in range(2):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / iters, 4)


def attempt(fn: Callable[[], float]) -> float | str:
    try:
        return fn()
    except Exception as error:  # reported, so one missing backend does not hide the others
        return f"{type(error).__name__}: {error}"[:300]


def attention(seq_len: int, docs: int, iters: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hq, hkv, dim = 16, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(seq_len, hq, dim, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    k = torch.randn(seq_len, hkv, dim, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    v = torch.randn(seq_len, hkv, dim, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    grad = torch.randn(seq_len, hq, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    bounds = [seq_len * i // docs for i in range(docs + 1)]
    cu = torch.tensor(bounds, device="cuda", dtype=torch.int32)
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))

    def varlen() -> torch.Tensor:  # laden's call: it adapts to the installed torch's signature
        from laden.model.attention import _varlen_kernel

        return _varlen_kernel(q, k, v, cu, longest, None, None)

    def per_doc() -> torch.Tensor:
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            qd, kd, vd = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
            outs.append(
                F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
            )
        return torch.cat(outs)

    def per_doc_expanded() -> torch.Tensor:  # key/value heads repeated: backends without GQA
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            qd = q[a:b].transpose(0, 1)[None]
            kd, vd = (t[a:b].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)[None] for t in (k, v))
            outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)[0].transpose(0, 1))
        return torch.cat(outs)

    def measure(run: Callable[[], torch.Tensor], backend=None) -> dict:
        def ctx():
            return sdpa_kernel([backend]) if backend is not None else torch.enable_grad()

        def fwd() -> None:
            with ctx(), torch.no_grad():
                run()

        def fwd_bwd() -> None:
            with ctx():
                run().backward(grad)

        with ctx():
            ref = run().float()
        return {"fwd_ms": attempt(lambda: timed(fwd, iters)), "fwd_bwd_ms": attempt(lambda: timed(fwd_bwd, iters)),
                "out_checksum": round(float(ref.abs().mean()), 5)}  # fmt: skip

    result: dict = {"varlen": attempt(lambda: measure(varlen))}
    for name, backend in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:  # fmt: skip
        result[f"sdpa_{name}"] = attempt(lambda b=backend: measure(per_doc, b))
        result[f"sdpa_{name}_expanded_kv"] = attempt(lambda b=backend: measure(per_doc_expanded, b))
    return result


def grad_fold(tokens: int, iters: int) -> dict:
    out_features, in_features = 6144, 2048
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16, generator=gen)
    g = torch.randn(tokens, out_features, device="cuda", dtype=torch.bfloat16, generator=gen)
    acc = torch.zeros(out_features, in_features, device="cuda", dtype=torch.float32)

    def gemm_then_add() -> None:
        acc.add_(g.t() @ x)

    def gemm_only() -> None:
        g.t() @ x

    def fp32_out_accumulate() -> None:
        torch.addmm(acc, g.t(), x, out_dtype=torch.float32, out=acc)

    def fp32_out_then_add() -> None:
        acc.add_(torch.mm(g.t(), x, out_dtype=torch.float32))

    result: dict = {"tokens": tokens, "shape": [out_features, in_features]}
    for name, fn in [("bf16_gemm_only", gemm_only), ("bf16_gemm_then_fp32_add", gemm_then_add),
                     ("fp32_out_addmm_in_place", fp32_out_accumulate), ("fp32_out_mm_then_add", fp32_out_then_add)]:  # fmt: skip
        result[name + "_ms"] = attempt(lambda f=fn: timed(f, iters))

    # The in-place fp32-output GEMM must equal the reference sum: fp32 accumulation of the product.
    def check() -> float:
        acc.zero_()
        torch.addmm(acc, g.t(), x, out_dtype=torch.float32, out=acc)
        torch.addmm(acc, g.t(), x, out_dtype=torch.float32, out=acc)
        ref = 2 * (g.t().float() @ x.float())
        return round(float((acc - ref).abs().max() / ref.abs().max()), 7)

    result["fp32_out_addmm_rel_err"] = attempt(check)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per micro-batch")
    p.add_argument(
        "--docs", type=int, nargs="+", default=[1, 2], help="documents per micro-batch, one run each"
    )
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no GPU"}))
        return 0
    out = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "attention": {
            f"{args.seq_len}x{d}docs": attention(args.seq_len * d, d, args.iters) for d in args.docs
        },
        "grad_fold": grad_fold(args.seq_len, args.iters),
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
