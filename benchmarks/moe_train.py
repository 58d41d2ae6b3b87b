"""A small Qwen3-MoE shape trained by `archon:d1` beside `fsdp:d1`: tokens/s and peak GPU memory.

Both engines are built the way `laden sft` builds them (a `LadenConfig`, the runtime's model patches,
`laden.engine.factory.build_engine`), from the same random init, in one process each (a fresh one per
backend, so each peak is its own), and train on the same random packed micro-batches: `--num-seqs`
sequences of `--seq-len` tokens per optimizer step, `--max-tokens-per-mb` tokens per micro-batch.
The archon engine adds the router's load-balancing loss (`actor.archon.router_aux_loss_coef`, default the
model's 0.001) and reports its metrics; fsdp trains the plain next-token loss. One JSON line per backend.

    python benchmarks/moe_train.py --backend archon:d1 --steps 6 --warmup 2
    python benchmarks/moe_train.py --backend fsdp:d1
    python benchmarks/moe_train.py --shape tiny --steps 2   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import git_commit  # noqa: E402

SHAPES = {
    # Qwen3-30B-A3B's layout (128 experts, 8 active, 768 wide) scaled down: 64 experts, 8 active, 384 wide.
    "qwen3-moe-small": dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
                            head_dim=64, intermediate_size=3072, moe_intermediate_size=384, num_experts=64,
                            num_experts_per_tok=8, vocab_size=151936, tie_word_embeddings=False),
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                 vocab_size=128, tie_word_embeddings=False),
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="archon:d1")
    p.add_argument("--shape", default="qwen3-moe-small", choices=sorted(SHAPES))
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--num-seqs", type=int, default=8)
    p.add_argument("--max-tokens-per-mb", type=int, default=8192)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gradient-checkpointing", action="store_true")
    return p.parse_args(argv)


def config(args: argparse.Namespace, model_dir: Path, device: torch.device):
    from laden.config import load_config

    dtype = "bfloat16" if device.type == "cuda" else "float32"
    return load_config("examples/sft_tiny.yaml", [
        f"actor.path={model_dir}", f"actor.backend={args.backend}", f"actor.dtype={dtype}",
        f"actor.mb_spec.max_tokens_per_mb={args.max_tokens_per_mb}", f"train_dataset.max_length={args.seq_len}",
        f"actor.gradient_checkpointing={str(args.gradient_checkpointing).lower()}", "actor.optimizer.type=adam",
        "actor.optimizer.lr=1e-5",
    ], job="sft")  # fmt: skip


def batches(args: argparse.Namespace, vocab: int, num_steps: int, device: torch.device) -> list[list]:
    from laden.data import pack_samples

    g = torch.Generator().manual_seed(0)
    per_mb = max(1, args.max_tokens_per_mb // args.seq_len)
    out = []
    for _ in range(num_steps):
        docs = [(torch.randint(3, vocab, (args.seq_len,), generator=g).tolist(), [1] * args.seq_len)
                for _ in range(args.num_seqs)]  # fmt: skip
        out.append([pack_samples(docs[i : i + per_mb]).to(device) for i in range(0, len(docs), per_mb)])
    return out


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from laden.engine.backend import resolve_backend
    from laden.engine.factory import build_engine
    from laden.engine.runtime import patch_model

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        shape = Qwen3MoeConfig(**SHAPES[args.shape], max_position_embeddings=args.seq_len)
        shape.save_pretrained(tmp)
        cfg = config(args, Path(tmp), device)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(shape, dtype=torch.float32)
        patch_model(cfg, model, resolve_backend(cfg))
        engine = build_engine(cfg, model, total_steps=args.steps, device=device)
    steps = batches(args, shape.vocab_size, args.steps, device)
    losses, extra, t0 = [], {}, 0.0
    for i, mbs in enumerate(steps):
        if i == args.warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        out = engine.train_batch(mbs, global_num_loss_tokens=sum(mb.num_loss_tokens for mb in mbs))
        losses.append(float(out["loss"]))  # a host sync per step, as laden sft's log line
        extra = {k: float(v) for k, v in out.items() if k.startswith("moe_")}
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens = (args.steps - args.warmup) * args.num_seqs * args.seq_len
    total = (
        sum(p.numel() for p in model.parameters()) if args.backend.startswith("fsdp") else engine.num_params
    )
    return {
        "bench": "moe_train", "backend": args.backend, "shape": args.shape, "params_b": round(total / 1e9, 3),
        "seq_len": args.seq_len, "num_seqs": args.num_seqs, "max_tokens_per_mb": args.max_tokens_per_mb,
        "gradient_checkpointing": args.gradient_checkpointing, "tokens_per_s": round(tokens / seconds, 1),
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
        "losses": [round(x, 4) for x in losses], "valid": all(math.isfinite(x) for x in losses), **extra,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "commit": git_commit(),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    try:
        result = run(parse_args(argv))
    except torch.OutOfMemoryError as err:
        result = {"bench": "moe_train", "valid": False, "error_kind": "gpu_oom", "error": str(err)[:300]}
    print(json.dumps(result), flush=True)
    return 0 if result.get("valid") else 1


if __name__ == "__main__":
    sys.exit(main())
