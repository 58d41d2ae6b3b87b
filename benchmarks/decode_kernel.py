"""The Triton paged decode kernel alone: time and KV-cache read bandwidth per launch configuration.

One JSON line per (case, configuration): microseconds per call (CUDA events over `--iters`
calls after a warm-up) and the bandwidth of the keys and values it must read. Cases, the
Qwen3-0.6B attention shape (16 query heads, 8 KV heads, head dim 128, bf16, pages of 32):

    A      256 rows of 128 to 384 tokens (workload A mid-run)
    B      256 rows uniform in [200, 2048] tokens (workload B's mix)
    small  16 rows of 2,000 tokens (a small batch of long rows)
    r16, r32, r64  16 / 32 / 64 rows uniform in [200, 2048] (workload B's later steps)
    tiny   2 rows of 4,000 tokens (too few rows to fill the GPU unsplit)

Each configuration is timed inside a CUDA graph of `--iters` calls, as the engine runs it
(`--eager`: launched back to back from Python, where the launches of the split and merge
kernels can cost more than the kernels: the second round's figures were taken so).

    python benchmarks/decode_kernel.py                       # every case, the configuration grid
    python benchmarks/decode_kernel.py --cases B --tiles 64 --warps 4 --stages 2
    python benchmarks/decode_kernel.py --cases small r16 r32 r64 tiny --tiles 128 --warps 4 --stages 2 --splits none auto 4 8 16

`--mask-loads` (`auto`: the kernel's rule, masked when unsplit), `--order` (`default`:
`HEADS_INNER`), `--prefetch-table` (`default`: `PREFETCH_TABLE`) and `--heads-per-program`
(`default`: `HEADS_PER_PROGRAM`) and `--max-registers` (`default`: `MAX_REGISTERS`) compare the
kernel's load modes, program orders, block-table loads, KV heads a program and register caps.

`split` is `none` (one program per row and KV head), `auto` (`split_pages_for`, the engine's
choice: `none` once rows x KV heads make four programs an SM, else 256-token splits) or a number
of pages.
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
from bench_common import cuda_graph_us, git_commit  # noqa: E402


def lengths_for(case: str) -> list[int]:
    g = torch.Generator().manual_seed(0)
    if case == "A":
        return torch.randint(128, 385, (256,), generator=g).tolist()
    if case == "B":
        return torch.randint(200, 2049, (256,), generator=g).tolist()
    if case == "small":
        return [2000] * 16
    if case in ("r16", "r32", "r64", "r128"):  # workload B's later steps: fewer rows of its length mix
        return torch.randint(200, 2049, (int(case[1:]),), generator=g).tolist()
    return [4000] * 2


def eager_us(call, iters: int) -> float:
    """Microseconds a call, launched back to back from Python (launch costs included)."""
    for _ in range(5):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["A", "B", "small", "tiny"])
    ap.add_argument("--tiles", nargs="+", type=int, default=[32, 64, 128])
    ap.add_argument("--warps", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--stages", nargs="+", type=int, default=[2, 3])
    ap.add_argument("--splits", nargs="+", default=["none", "auto", "8", "16"])
    ap.add_argument(
        "--mask-loads", nargs="+", choices=["auto", "on", "off"], default=["auto"],
        help="on: tokens past a row's end are not read; off: read, then masked; auto: the kernel's default",
    )  # fmt: skip
    ap.add_argument(
        "--order", nargs="+", choices=["default", "rows", "heads"], default=["default"],
        help="program order: one KV head of consecutive rows (rows) or a row's KV heads adjacent (heads)",
    )  # fmt: skip
    ap.add_argument(
        "--prefetch-table", nargs="+", choices=["default", "on", "off"], default=["default"],
        help="on: each iteration loads the next tile's block numbers; off: its own; default: PREFETCH_TABLE",
    )  # fmt: skip
    ap.add_argument(
        "--heads-per-program", nargs="+", default=["default"], choices=["default", "1", "2"],
        help="KV heads a program attends (default: HEADS_PER_PROGRAM); --tiles counts one head's tokens",
    )  # fmt: skip
    ap.add_argument(
        "--max-registers", nargs="+", default=["default"],
        help="registers a thread may use (Triton's maxnreg): default (MAX_REGISTERS), none, or a number",
    )  # fmt: skip
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument(
        "--eager", action="store_true", help="time calls launched from Python, not in a CUDA graph"
    )
    args = ap.parse_args()

    from paged_case import paged_case

    from laden.rollout.native.attention import decode_attention_torch
    from laden.rollout.native.kernels.triton_decode import paged_decode, split_pages_for

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    hq, hkv, d, page = 16, 8, 128, 32
    commit = git_commit()
    for case in args.cases:
        lengths = lengths_for(case)
        q, kc, vc, table, lens = paged_case(len(lengths), hq, hkv, d, page, lengths, torch.bfloat16, "cuda")
        width = max(2048, max(lengths)) // page + 2  # the engine's tables are as wide as max_model_len
        table = torch.nn.functional.pad(table, (0, width - table.shape[1]))
        ref = decode_attention_torch(q.float(), kc.float(), vc.float(), table, lens, d**-0.5)
        read = sum(lengths) * hkv * d * 2 * 2  # keys and values, bf16
        best = None
        grid = itertools.product(
            args.tiles, args.warps, args.stages, args.splits, args.mask_loads, args.order, args.prefetch_table,
            args.heads_per_program, args.max_registers,
        )  # fmt: skip
        for tile, warps, stages, split, mask, order, prefetch, pair, regs in grid:
            pages = (
                None
                if split == "none"
                else split_pages_for(len(lengths), hkv, width, page, sms)
                if split == "auto"
                else int(split)
            )

            call = functools.partial(
                paged_decode, q, kc, vc, table, lens, d**-0.5, pages,
                tile_tokens=tile, num_warps=warps, num_stages=stages, mask_loads=None if mask == "auto" else mask == "on",
                heads_inner=None if order == "default" else order == "heads",
                prefetch_table=None if prefetch == "default" else prefetch == "on",
                heads_per_program=None if pair == "default" else int(pair),
                max_registers=None if regs == "default" else 0 if regs == "none" else int(regs),
            )  # fmt: skip

            try:
                out = call()
            except Exception as e:  # noqa: BLE001 - a configuration Triton cannot build (shared memory)
                print(json.dumps({"case": case, "tile": tile, "warps": warps, "stages": stages, "split": split,
                                  "mask_loads": mask, "order": order, "prefetch_table": prefetch, "heads_per_program": pair, "max_registers": regs, "error": f"{type(e).__name__}: {str(e)[:120]}"}), flush=True)  # fmt: skip
                continue
            err = float((out.float() - ref).abs().max())
            us = (
                eager_us(call, args.iters)
                if args.eager
                else cuda_graph_us(lambda _, call=call: call(), args.iters, replays=5)
            )
            row = {
                "case": case, "rows": len(lengths), "tokens": sum(lengths), "tile": tile, "warps": warps,
                "stages": stages, "split": split, "split_pages": pages, "mask_loads": mask, "order": order,
                "prefetch_table": prefetch, "heads_per_program": pair, "max_registers": regs,
                "us": round(us, 1),
                "tb_s": round(read / us / 1e6, 3), "max_err": round(err, 4), "git_commit": commit,
            }  # fmt: skip
            print(json.dumps(row), flush=True)
            if err < 5e-2 and (best is None or us < best["us"]):
                best = row
        print(json.dumps({"case": case, "best": best}), flush=True)


if __name__ == "__main__":
    main()
