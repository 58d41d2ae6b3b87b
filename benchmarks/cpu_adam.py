"""Host AdamW throughput: params/s of one update over a large tensor, per backend and kernel.

Prints one JSON line per (backend, kernel). Kernels:
- fp32: fp32 param/grad/moments (the plain host AdamW step);
- fp32_bf16io: fp32 param/moments, bf16 grad in, bf16 upload copy out (the roundpipe case);
- bf16_kahan: bf16 param/comp/moments, bf16 grad (`adam_bf16` on the host).

`bytes_per_param` counts the memory traffic of one fused pass (reads + writes); `gb_per_s`
is that traffic over the measured time, to compare with the machine's memory bandwidth.

    python benchmarks/cpu_adam.py --numel 100000000 --threads 16
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from laden.optim import adamw_bf16_kahan_step_, adamw_step_, backend_name

HPARAMS = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
BYTES_PER_PARAM = {"fp32": 16 + 12, "fp32_bf16io": 14 + 14, "bf16_kahan": 10 + 8}


def _buffers(kernel: str, numel: int) -> dict[str, torch.Tensor]:
    if kernel == "bf16_kahan":
        bf16 = {"dtype": torch.bfloat16}
        return {
            "param_bf16": torch.randn(numel, **bf16),
            "comp_bf16": torch.zeros(numel, **bf16),
            "grad": torch.randn(numel, **bf16),
            "exp_avg_bf16": torch.zeros(numel, **bf16),
            "exp_avg_sq_bf16": torch.zeros(numel, **bf16),
        }
    grad_dtype = torch.bfloat16 if kernel == "fp32_bf16io" else torch.float32
    buffers = {
        "param": torch.randn(numel),
        "grad": torch.randn(numel, dtype=grad_dtype),
        "exp_avg": torch.zeros(numel),
        "exp_avg_sq": torch.zeros(numel),
    }
    if kernel == "fp32_bf16io":
        buffers["param_out_bf16"] = torch.empty(numel, dtype=torch.bfloat16)
    return buffers


def bench(backend: str, kernel: str, *, numel: int, num_threads: int, num_iters: int) -> dict:
    buffers = _buffers(kernel, numel)
    fn = adamw_bf16_kahan_step_ if kernel == "bf16_kahan" else adamw_step_
    times = []
    for step in range(1, num_iters + 2):  # the first call warms up (page faults, thread pool)
        start = time.perf_counter()
        fn(**buffers, step=step, **HPARAMS, num_threads=num_threads, backend=backend)
        times.append(time.perf_counter() - start)
    seconds = min(times[1:])
    return {
        "backend": backend,
        "kernel": kernel,
        "numel": numel,
        "threads": num_threads,
        "seconds_per_step": round(seconds, 4),
        "params_per_s": round(numel / seconds),
        "bytes_per_param": BYTES_PER_PARAM[kernel],
        "gb_per_s": round(numel * BYTES_PER_PARAM[kernel] / seconds / 1e9, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=100_000_000)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # the torch backend's thread count
    backends = ["cpp", "torch"] if backend_name() == "cpp" else ["torch"]
    for backend in backends:
        for kernel in ("fp32", "fp32_bf16io", "bf16_kahan"):
            result = bench(backend, kernel, numel=args.numel, num_threads=args.threads, num_iters=args.iters)
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
