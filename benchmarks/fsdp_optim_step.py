"""Optimizer-step time and device peak: host AdamW vs the per-layer streamed step (`actor.fsdp.*`).

Variants (each a fresh engine on the same model and data):
- `resident`: no offload, states on the GPU (the fastest step, the largest device footprint);
- `offload_host`: `offload_params`, the AdamW update on the CPU (the seed's slow default);
- `offload_streamed_pN`: `offload_params` + `per_layer_optim_step`, prefetch N layers;
- `streamed_pN`: `per_layer_optim_step` alone (states on the host, params on the GPU).

Per variant and rank one JSON line: `step_s` (median optimizer step incl. clipping, after
one warm-up step), `gpu_peak_step_gib` (allocated peak during the step, above what the
forward/backward left) and `gpu_peak_total_gib`.

    torchrun --nproc_per_node 2 benchmarks/fsdp_optim_step.py --layers 16
    python benchmarks/fsdp_optim_step.py --variants offload_host,offload_streamed_p1   # one GPU
"""

from __future__ import annotations

import argparse
import statistics
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
    random_micro_batches,
)

from laden.engine.parallel.launch import init_distributed  # noqa: E402

VARIANTS = {
    "resident": {},
    "offload_host": {"offload_params": True},
    "offload_streamed_p1": {
        "offload_params": True,
        "per_layer_optim_step": True,
        "optim_step_prefetch_layers": 1,
    },
    "offload_streamed_p2": {
        "offload_params": True,
        "per_layer_optim_step": True,
        "optim_step_prefetch_layers": 2,
    },
    "streamed_p1": {"per_layer_optim_step": True, "optim_step_prefetch_layers": 1},
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_variant(name: str, args, model_dir: Path, world_size: int, device: torch.device) -> None:
    engine = benchmark_engine(model_dir, world_size=world_size, device=device, **VARIANTS[name])
    mbs = random_micro_batches(1, args.tokens_per_mb, 512, args.vocab, seed=engine.dp_rank)
    total = sum(mb.num_loss_tokens for mb in mbs) * world_size
    times, step_peaks = [], []
    for _ in range(args.steps + 1):
        engine.forward_backward(mbs, engine.objective, normalizer=float(total))
        sync(device)  # deliberate: time the optimizer step alone
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        engine.optimizer_step()
        sync(device)
        times.append(time.perf_counter() - start)
        step_peaks.append((device_peak_gib(device) * 2**30 - before) / 2**30)
    emit(
        {
            "variant": name,
            **VARIANTS[name],
            "num_params": engine.num_params,
            "step_s": round(statistics.median(times[1:]), 4),
            "gpu_peak_step_gib": round(max(step_peaks[1:]), 3),
            "gpu_peak_total_gib": round(device_peak_gib(device), 3),
        }
    )
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {list(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tokens-per-mb", type=int, default=2048)
    args = parser.parse_args()
    _, world_size, _, device = init_distributed()
    model_dir = ensure_model_dir(args)
    for name in args.variants.split(","):
        if name not in VARIANTS:
            raise ValueError(f"--variants: unknown variant {name!r}; choose from {list(VARIANTS)}")
        run_variant(name, args, model_dir, world_size, device)


if __name__ == "__main__":
    main()
