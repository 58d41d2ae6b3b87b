"""Shared pieces of the fsdp benchmarks: a sized random Qwen3 on disk, random packed batches, peaks.

Not a benchmark itself. The model is written once (rank 0) as a real safetensors directory
so that loading measures the real path; its size comes from `--hidden`, `--layers` and
`--vocab` (defaults: ~1.3B parameters, Qwen3-1.7B-like widths).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from laden.data.batch import pack_samples


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", default="/tmp/laden_bench_qwen3", help="written once if missing")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=6144)
    parser.add_argument("--vocab", type=int, default=151936)


def ensure_model_dir(args: argparse.Namespace) -> Path:
    """Rank 0 writes a random-init model (bf16 safetensors) if the directory has none; all ranks wait."""
    out = Path(args.model_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and not (out / "config.json").exists():
        from transformers import AutoModelForCausalLM, Qwen3Config

        cfg = Qwen3Config(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=args.intermediate,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            head_dim=args.hidden // args.heads,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)
    if dist.is_initialized():
        dist.barrier()
    return out


def reset_host_peak() -> None:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process (Linux)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def host_peak_gib() -> float:
    """Peak resident set size since the last reset, GiB (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 2**30
    return float("nan")


def device_peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def random_micro_batches(num_mbs: int, tokens_per_mb: int, doc_len: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    mbs = []
    for _ in range(num_mbs):
        docs = []
        for _ in range(max(1, tokens_per_mb // doc_len)):
            ids = torch.randint(0, vocab, (doc_len,), generator=g).tolist()
            docs.append((ids, [1] * doc_len))
        mbs.append(pack_samples(docs))
    return mbs


def benchmark_engine(model_dir: Path, *, world_size: int, device: torch.device, **options):
    """The engine both FSDP benchmarks measure: data parallel over every rank, bf16 compute over fp32
    masters, gradient checkpointing; `options` are the `actor.fsdp.*` knobs under test."""
    from laden.engine.fsdp import FSDPEngine
    from laden.engine.fsdp.load import load_model_for_rank
    from laden.optim import OptimSettings

    model = load_model_for_rank(
        str(model_dir), dtype=torch.float32, memory_efficient_load=options.get("memory_efficient_load", False)
    )
    return FSDPEngine(
        model,
        dp=world_size,
        device=device,
        dtype=torch.bfloat16,
        optimizer_dtype=torch.float32,
        optim=OptimSettings(lr=1e-5),
        gradient_checkpointing=True,
        **options,
    )


def emit(record: dict) -> None:
    """One JSON line per rank on stdout."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    print(
        json.dumps({"rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1")), **record}), flush=True
    )
