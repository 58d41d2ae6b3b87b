"""Host and GPU peaks per rank while loading and sharding a model, with and without memory_efficient_load.

Run it once per setting (the host peak is per process), e.g. on 2 GPUs:

    torchrun --nproc_per_node 2 benchmarks/fsdp_memory_load.py
    torchrun --nproc_per_node 2 benchmarks/fsdp_memory_load.py --memory-efficient-load

Each rank prints one JSON line: `host_peak_gib` (VmHWM from just before loading to the
first optimizer step), `gpu_peak_gib`, `load_s` (model read + shard + weights in place)
and `step_s` (one training step, to show the loaded engine works). Expected: without the
knob every rank's host peak holds one full model; with it only rank 0's does.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_common import (  # noqa: E402
    add_model_args,
    benchmark_engine,
    device_peak_gib,
    emit,
    ensure_model_dir,
    host_peak_gib,
    random_micro_batches,
    reset_host_peak,
)

from laden.engine.parallel.launch import init_distributed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)
    parser.add_argument("--memory-efficient-load", action="store_true")
    parser.add_argument("--tokens-per-mb", type=int, default=4096)
    args = parser.parse_args()

    _, world_size, _, device = init_distributed()
    model_dir = ensure_model_dir(args)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    reset_host_peak()
    start = time.perf_counter()
    engine = benchmark_engine(
        model_dir, world_size=world_size, device=device, memory_efficient_load=args.memory_efficient_load
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    load_s = time.perf_counter() - start
    host_load, gpu_load = host_peak_gib(), device_peak_gib(device)

    mbs = random_micro_batches(1, args.tokens_per_mb, 512, args.vocab, seed=engine.dp_rank)
    total = sum(mb.num_loss_tokens for mb in mbs) * world_size
    start = time.perf_counter()
    out = engine.train_batch(mbs, global_num_loss_tokens=total)
    loss = float(out["loss"])  # sync: the step must be finished to time it
    emit(
        {
            "memory_efficient_load": args.memory_efficient_load,
            "num_params": engine.num_params,
            "load_s": round(load_s, 2),
            "host_peak_load_gib": round(host_load, 3),
            "gpu_peak_load_gib": round(gpu_load, 3),
            "step_s": round(time.perf_counter() - start, 3),
            "gpu_peak_step_gib": round(device_peak_gib(device), 3),
            "loss": round(loss, 4),
        }
    )


if __name__ == "__main__":
    main()
