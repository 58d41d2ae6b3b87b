"""DeepSpeed ZeRO-Offload on BENCHMARKS.md's reference workload, under the same GPU cap as laden's
roundpipe engine: the offloaded trainer users pick when a model's training state does not fit.

    python benchmarks/deepspeed_offload.py --stage 3 --micro-batch 1 --gradient-checkpointing
    python benchmarks/deepspeed_offload.py --stage 2 --micro-batch 4 --no-gradient-checkpointing
    python benchmarks/deepspeed_offload.py --print-config --stage 3 --micro-batch 2   # no GPU needed

The model is stock Hugging Face (the Qwen3 shape, random init from its config, SDPA attention, its
own loss), trained by DeepSpeed's engine in bf16 with fp32 master weights and AdamW state in host
memory (ZeRO stage 2: `offload_optimizer` to the CPU, the bf16 parameters and gradients on the GPU;
stage 3: `offload_param` too, parameters streamed to the GPU layer by layer), DeepSpeed's CPU Adam
(built on first use by its op builder, with the machine's nvcc and ninja), pinned host buffers,
gradient clipping 1.0, lr 1e-5: the work of `train_throughput.py --system laden --optim-step sync
--clip 1` (the exact synchronous step). A step is `--num-seqs` sequences of `--seq-len` tokens as
`--num-seqs / --micro-batch` micro-batches of unpacked rows (DeepSpeed's gradient accumulation), so
every micro-batch has the same tokens and the mean of the micro-batch means is the step's token mean.

`--gpu-mem-cap-gib` caps every process's GPU allocator (`set_per_process_memory_fraction`, as
`train_throughput.py` caps laden), with the allocator setting of the environment (the drivers set
`expandable_segments:True` for every system). One JSON line: tokens/s over `--steps` timed steps
after `--warmup`, the seconds of each, peak GPU memory (allocated and reserved) and peak host
memory (the process's resident set). A GPU out-of-memory error gives the line with `"error_kind":
"gpu_oom"` and exit status 1, so a sweep records what does not fit.

Imports torch, transformers, deepspeed and the standard library only: no laden code runs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import QWEN3_SHAPES  # noqa: E402

GIB = 1 << 30
SHAPES = {
    **QWEN3_SHAPES,
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=True),
}  # fmt: skip
"""The reference shapes and a tiny one (a CPU run of the driver's plumbing, which reports no_gpu)."""


def ds_config(args: argparse.Namespace) -> dict[str, Any]:
    """DeepSpeed's configuration for this run (see the module docstring)."""
    if args.num_seqs % args.micro_batch:
        raise SystemExit(f"--micro-batch {args.micro_batch} must divide --num-seqs {args.num_seqs}")
    zero: dict[str, Any] = {
        "stage": args.stage,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
    }
    if args.stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        zero["stage3_max_live_parameters"] = 1e9
        zero["stage3_prefetch_bucket_size"] = 5e7
        zero["stage3_param_persistence_threshold"] = 1e5
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.num_seqs // args.micro_batch,
        "bf16": {"enabled": True},
        "gradient_clipping": args.clip,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
        },
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=list(SHAPES), default="qwen3-1.7b")
    p.add_argument("--stage", type=int, choices=[2, 3], default=3)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (1, 2, 4)")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--num-seqs", type=int, default=16, help="sequences per optimizer step")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gpu-mem-cap-gib", type=float, default=24.0)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--print-config", action="store_true", help="print DeepSpeed's config and exit")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = ds_config(args)
    if args.print_config:
        print(json.dumps(config, indent=2))
        return 0
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    if not torch.cuda.is_available():  # DeepSpeed's offload needs a CUDA device and its CPU Adam kernel
        print(json.dumps({"bench": "deepspeed_offload", "valid": False, "error_kind": "no_gpu",
                          "error": "DeepSpeed ZeRO-Offload runs on a CUDA GPU; none is visible"}))  # fmt: skip
        return 1

    for name, value in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
    ):
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_PORT", "29517")
    import deepspeed

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_mem_cap_gib * GIB / total), 0)
    torch.manual_seed(args.seed)
    record: dict[str, Any] = {
        "bench": "deepspeed_offload", "deepspeed": deepspeed.__version__, "model": args.model, "stage": args.stage,
        "offload": "optimizer+params" if args.stage == 3 else "optimizer", "micro_batch": args.micro_batch,
        "gradient_checkpointing": args.gradient_checkpointing, "seq_len": args.seq_len, "num_seqs": args.num_seqs,
        "gpu_mem_cap_gib": args.gpu_mem_cap_gib,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    }  # fmt: skip
    shape = SHAPES[args.model]
    cfg = Qwen3Config(**shape, max_position_embeddings=max(args.seq_len, 4096), attn_implementation="sdpa")
    t0 = time.perf_counter()
    if args.stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=config):  # built partitioned, never whole on one device
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    record["setup_s"] = round(time.perf_counter() - t0, 1)
    gen = torch.Generator().manual_seed(args.seed)
    accum = args.num_seqs // args.micro_batch
    times: list[float] = []
    try:
        for step in range(args.warmup + args.steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(accum):
                ids = torch.randint(0, shape["vocab_size"], (args.micro_batch, args.seq_len), generator=gen)
                ids = ids.to(engine.device)
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary
            torch.cuda.synchronize()
            if not torch.isfinite(loss):
                raise RuntimeError(f"loss became {loss.item()} at step {step + 1}")
            if step >= args.warmup:
                times.append(time.perf_counter() - t)
    except torch.OutOfMemoryError as exc:
        record.update(error_kind="gpu_oom", error=str(exc).splitlines()[0][:300], timed_steps=len(times))
        print(json.dumps(record), flush=True)
        return 1
    step_s = sum(times) / len(times)
    record.update(
        step_s=[round(x, 3) for x in times], tokens_per_s=round(args.num_seqs * args.seq_len / step_s, 1),
        peak_gpu_gib=round(torch.cuda.max_memory_allocated() / GIB, 2),
        peak_gpu_reserved_gib=round(torch.cuda.max_memory_reserved() / GIB, 2),
        peak_host_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        last_loss=round(float(loss), 4),
    )  # fmt: skip
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
