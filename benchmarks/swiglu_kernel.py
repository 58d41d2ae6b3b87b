"""The decode layer's SwiGLU alone: the compiled torch function the engine runs now (inductor,
dynamic shapes) against laden's Triton kernel (`triton_swiglu.swiglu`), per row count.

One JSON line per (rows, path): microseconds a call inside a CUDA graph of `--iters` calls, as the
engine's decode graphs run it, and the bandwidth of its reads and writes, over bf16 `[rows, 2I]`
inputs of Qwen3-0.6B's I = 3,072 (`--half`). 32,768 rows is workload A's prefill.

    python benchmarks/swiglu_kernel.py
    python benchmarks/swiglu_kernel.py --rows 256 --blocks 512 1024 2048 --warps 4 8
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
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64, 128, 256, 32768])
    ap.add_argument("--half", type=int, default=3072, help="I: the MLP's intermediate size")
    ap.add_argument("--blocks", nargs="+", type=int, default=[1024])
    ap.add_argument("--warps", nargs="+", type=int, default=[4])
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("swiglu_kernel.py times the decode layer's SwiGLU on a GPU; this machine has none")

    from laden.rollout.native.kernels.triton_swiglu import swiglu
    from laden.rollout.native.model import _swiglu

    compiled = torch.compile(_swiglu, dynamic=True)
    dev = torch.device("cuda")
    commit = git_commit()
    for rows in args.rows:
        gu = torch.randn(rows, 2 * args.half, device=dev).to(torch.bfloat16)
        want = _swiglu(gu.float())
        moved = gu.numel() * 2 * 1.5  # read 2I, write I, bf16
        calls = {"compiled": compiled} | {
            f"triton:{b}x{w}": functools.partial(swiglu, block=b, num_warps=w)
            for b, w in itertools.product(args.blocks, args.warps)
        }
        iters = args.iters if rows <= 4096 else 10
        for path, fn in calls.items():
            err = float((fn(gu).float() - want).abs().max())
            us = cuda_graph_us(lambda _, fn=fn, gu=gu: fn(gu), iters, replays=5)
            print(json.dumps({
                "bench": "swiglu_kernel", "rows": rows, "half": args.half, "path": path, "us": round(us, 2),
                "tb_s": round(moved / us / 1e6, 3), "max_err": round(err, 4), "git_commit": commit,
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
