"""The fused sampler alone (`laden.rollout.native.kernels.triton_sampler.sample_fused`): time per decode
step's call and the logits' read bandwidth, per chunk length and warp count.

One JSON line per (rows, method, chunk, warps): microseconds a call inside a CUDA graph of `--iters` calls,
as the engine's decode graphs run it, over bf16 logits of Qwen3's vocabulary (151,936), every row
sampling at temperature 1 (`--greedy`: argmax rows, which draw no random numbers). The chunk
and the method (`race`, `cdf`: see `SamplerOptions.method`) change the draws, not their
distribution.

    python benchmarks/sampler_kernel.py                                  # 64 and 256 rows, the grid
    python benchmarks/sampler_kernel.py --rows 256 --chunks 4096 --warps 4
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import cuda_graph_us, git_commit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", type=int, default=[64, 256])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--chunks", nargs="+", type=int, default=[2048, 4096, 8192])
    ap.add_argument("--warps", nargs="+", type=int, default=[2, 4, 8, 16])
    ap.add_argument("--greedy", action="store_true", help="argmax rows (no random numbers)")
    ap.add_argument("--methods", nargs="+", default=["race", "cdf"], choices=["race", "cdf"],
                    help="how sampled rows draw (triton_sampler.METHOD)")  # fmt: skip
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sampler_kernel.py times the Triton sampler on a GPU; this machine has none")

    from laden.rollout.native.kernels.options import SamplerOptions
    from laden.rollout.native.kernels.triton_sampler import sample_fused

    CHUNK, METHOD, NUM_WARPS = SamplerOptions().chunk, SamplerOptions().method, SamplerOptions().num_warps

    dev = torch.device("cuda")
    commit = git_commit()
    g = torch.Generator(device=dev).manual_seed(0)
    for rows in args.rows:
        logits = (torch.randn(rows, args.vocab, generator=g, device=dev) * 3).to(torch.bfloat16)
        temperature = torch.ones(rows, device=dev)
        greedy = torch.full((rows,), args.greedy, device=dev)
        seed = torch.tensor([1], dtype=torch.int64, device=dev)
        best = None
        for method, chunk, warps in itertools.product(args.methods, args.chunks, args.warps):
            offset = torch.zeros(1, dtype=torch.int64, device=dev)
            step = functools.partial(
                sample_fused,
                logits,
                temperature,
                greedy,
                seed,
                offset,
                chunk=chunk,
                num_warps=warps,
                method=method,
            )
            try:
                tokens, _ = step()
            except Exception as e:  # noqa: BLE001 - a configuration Triton cannot build
                print(json.dumps({"rows": rows, "method": method, "chunk": chunk, "warps": warps,
                                  "error": f"{type(e).__name__}: {str(e)[:120]}"}), flush=True)  # fmt: skip
                continue
            in_range = bool(((tokens >= 0) & (tokens < args.vocab)).all())
            us = cuda_graph_us(lambda _, step=step: step(), args.iters, replays=5)
            row = {
                "bench": "sampler_kernel", "rows": rows, "vocab": args.vocab, "method": method, "chunk": chunk,
                "warps": warps,
                "greedy": args.greedy, "us": round(us, 1), "tb_s": round(logits.numel() * 2 / us / 1e6, 3),
                "tokens_in_range": in_range, "default": (method, chunk, warps) == (METHOD, CHUNK, NUM_WARPS),
                "git_commit": commit,
            }  # fmt: skip
            print(json.dumps(row), flush=True)
            if in_range and (best is None or us < best["us"]):
                best = row
        print(json.dumps({"rows": rows, "best": best}), flush=True)


if __name__ == "__main__":
    main()
