"""The decode step's projections alone: cuBLAS (`F.linear`, `addmm` with the residual) against
laden's split-K Triton linear (`laden.rollout.native.kernels.triton_linear`) over a grid of tiles.

One JSON line per (projection, rows): microseconds a call and the weight-read bandwidth for
cuBLAS, for the configuration `pick_config` chooses and for the best of the grid. Each timing
replays a CUDA graph of one call per layer over `--layers` distinct copies of the weight (28,
the depth of Qwen3-0.6B: more bytes than the L2 cache holds, as in a real step), so launches
cost what they cost inside the engine's graphs and no weight is read from L2.

Projections (Qwen3-0.6B, bf16, q/k/v and gate/up fused as the engine runs them):
    qkv 4096 x 1024, o 1024 x 2048 (+ residual), gate_up 6144 x 1024, down 1024 x 3072 (+ residual)

    python benchmarks/skinny_gemm.py
    python benchmarks/skinny_gemm.py --rows 1 16 64 --shapes qkv down
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import cuda_graph_us, git_commit  # noqa: E402

SHAPES = {"qkv": (4096, 1024, False), "o": (1024, 2048, True), "gate_up": (6144, 1024, False),
          "down": (1024, 3072, True)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 32, 64, 128, 192, 256])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--block-n", nargs="+", type=int, default=[32, 64])
    ap.add_argument("--block-k", nargs="+", type=int, default=[128, 256])
    ap.add_argument("--splits", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--stages", nargs="+", type=int, default=[4])
    args = ap.parse_args()

    import torch.nn.functional as F

    from laden.rollout.native.kernels.triton_linear import LinearConfig, linear, pick_config

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    commit = git_commit()
    torch.manual_seed(0)
    for name in args.shapes:
        n, k, has_res = SHAPES[name]
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(args.layers)]
        gbytes = n * k * 2 / 1e9
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            res = torch.randn(m, n, device=dev, dtype=torch.bfloat16) if has_res else None
            ws = torch.empty(16 * m * n, device=dev, dtype=torch.float32)
            ref = F.linear(x, weights[0]) + (res if res is not None else 0)

            def cublas(i, x=x, res=res, weights=weights):
                w = weights[i]
                return torch.addmm(res, x, w.t()) if res is not None else F.linear(x, w)

            def triton_fn(cfg, x=x, res=res, ws=ws, weights=weights):
                return lambda i: linear(x, weights[i], res, cfg, ws)

            row = {"bench": "skinny_gemm", "shape": name, "n": n, "k": k, "rows": m, "residual": has_res,
                   "git_commit": commit, "device": torch.cuda.get_device_name(dev)}  # fmt: skip
            t = cuda_graph_us(cublas, args.layers)
            row["cublas_us"], row["cublas_tb_s"] = round(t, 2), round(gbytes / t * 1e6 / 1e3, 2)
            picked = pick_config(m, n, k, sms)
            if picked is not None:
                err = (linear(x, weights[0], res, picked, ws).float() - ref.float()).abs().max().item()
                t = cuda_graph_us(triton_fn(picked), args.layers)
                row.update(picked=str(picked), picked_us=round(t, 2), picked_err=err)
            best = None
            block_m = min(128, max(16, 1 << (m - 1).bit_length()))  # more rows: more row tiles
            for bn, bk, sp, st in itertools.product(args.block_n, args.block_k, args.splits, args.stages):
                if sp * bk > k:
                    continue
                cfg = LinearConfig(block_m, bn, bk, sp, 4, st)
                try:
                    t = cuda_graph_us(triton_fn(cfg), args.layers)
                except Exception as e:  # noqa: BLE001 - a configuration the compiler refuses (shared memory)
                    print(json.dumps({"skip": str(cfg), "error": str(e)[:200]}), file=sys.stderr)
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg)
            if best is not None:
                row.update(best=str(best[1]), best_us=round(best[0], 2),
                           best_tb_s=round(gbytes / best[0] * 1e6 / 1e3, 2))  # fmt: skip
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
