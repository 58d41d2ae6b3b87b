"""Host AdamW throughput: params/s of one update over a large tensor, per backend and kernel.

Prints one JSON line per (backend, kernel). Backends: `cpp` (the C++ kernel), `torch` (laden's
fallback: PyTorch's fused CPU AdamW for fp32 states, foreach math for bf16 + Kahan), `foreach`
(the `torch._foreach_*` math, the fallback before fused), and `torch.optim.AdamW` itself with
`foreach=True` / `fused=True` (`optim_foreach` / `optim_fused`; kernel `fp32` = fp32 params,
`bf16` = bf16 params and states). Kernels:
- fp32: fp32 param/grad/moments (the plain host AdamW step);
- fp32_bf16io: fp32 param/moments, bf16 grad in, bf16 upload copy out (the roundpipe case);
- bf16_kahan: bf16 param/comp/moments, bf16 grad (`adam_bf16` on the host).

`bytes_per_param` counts the memory traffic of one fused pass (reads + writes); `gb_per_s`
is that traffic over the measured time, to compare with the machine's memory bandwidth.

    python benchmarks/cpu_adam.py --numel 100000000 --threads 16
    python benchmarks/cpu_adam.py --numel 32000000 --iters 5   # benchmarks/RESULTS.md, "Host AdamW: fused"
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import torch

from laden.optim import (
    adamw_bf16_kahan_step_,
    adamw_foreach_,
    adamw_kahan_foreach_,
    adamw_scalars,
    adamw_step_,
    backend_name,
)

HPARAMS = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
BYTES_PER_PARAM = {"fp32": 16 + 12, "fp32_bf16io": 14 + 14, "bf16_kahan": 10 + 8, "bf16": 8 + 6}


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


def _foreach_step(kernel: str, buffers: dict[str, torch.Tensor], step: int) -> None:
    """The `torch._foreach_*` math on one tensor (the torch fallback before the fused kernel)."""
    s, b = adamw_scalars(step=step, **HPARAMS), buffers
    if kernel == "bf16_kahan":
        adamw_kahan_foreach_(
            [b["param_bf16"]], [b["comp_bf16"]], [b["grad"]], [b["exp_avg_bf16"]], [b["exp_avg_sq_bf16"]], s
        )
        return
    outs = [b["param_out_bf16"]] if "param_out_bf16" in b else None
    adamw_foreach_([b["param"]], [b["grad"]], [b["exp_avg"]], [b["exp_avg_sq"]], s, params_out_bf16=outs)


def _stepper(backend: str, kernel: str, numel: int, num_threads: int) -> Callable[[int], None]:
    if backend.startswith("optim_"):  # torch.optim.AdamW itself, foreach or fused
        dtype = torch.bfloat16 if kernel == "bf16" else torch.float32
        p = torch.randn(numel, dtype=dtype, requires_grad=True)
        p.grad = torch.randn(numel, dtype=dtype)
        betas = (HPARAMS["beta1"], HPARAMS["beta2"])
        kind = {backend.removeprefix("optim_"): True}
        opt = torch.optim.AdamW(
            [p],
            lr=HPARAMS["lr"],
            betas=betas,
            eps=HPARAMS["eps"],
            weight_decay=HPARAMS["weight_decay"],
            **kind,
        )
        return lambda step: opt.step()
    buffers = _buffers(kernel, numel)
    if backend == "foreach":
        return lambda step: _foreach_step(kernel, buffers, step)
    fn = adamw_bf16_kahan_step_ if kernel == "bf16_kahan" else adamw_step_
    return lambda step: fn(**buffers, step=step, **HPARAMS, num_threads=num_threads, backend=backend)


def bench(backend: str, kernel: str, *, numel: int, num_threads: int, num_iters: int) -> dict:
    step_fn = _stepper(backend, kernel, numel, num_threads)
    times = []
    for step in range(1, num_iters + 2):  # the first call warms up (page faults, thread pool)
        start = time.perf_counter()
        step_fn(step)
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
    backends = ["cpp", "torch", "foreach"] if backend_name() == "cpp" else ["torch", "foreach"]
    runs = [(b, k) for b in backends for k in ("fp32", "fp32_bf16io", "bf16_kahan")]
    runs += [(b, k) for b in ("optim_foreach", "optim_fused") for k in ("fp32", "bf16")]
    for backend, kernel in runs:
        result = bench(backend, kernel, numel=args.numel, num_threads=args.threads, num_iters=args.iters)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
