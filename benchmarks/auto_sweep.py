"""`auto` knobs against a hand-tuned sweep, under a GPU cap: tokens/s of `laden sft`, one process per run.

The workload: `laden sft` on a Qwen3 shape (random init, bf16 safetensors written once), fsdp:d1,
`--seq-len`-token sequences (a character tokenizer: one token a character), `--batch-size` of them a
step, under `--cap-gib` of GPU memory (`torch.cuda.set_per_process_memory_fraction`, as if on a card
that size; laden's budgets read the same fraction). The sweep sets `actor.gradient_checkpointing` and
`actor.mb_spec.max_tokens_per_mb` by hand over a grid; the `auto` run sets both to `auto`, with
`oom_policy: raise` everywhere, so a hand-set run that does not fit crashes (shown: `"error": "OOM"`).
One JSON line per run, then a summary: the best hand-tuned tokens/s, auto's, and their ratio.

    python benchmarks/auto_sweep.py --work /tmp/auto_sweep                 # H200, the default grid
    python benchmarks/auto_sweep.py --model tiny --seq-len 64 --batch-size 8 --steps 3 --warmup 1 --cap-gib 0  # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the character tokenizer
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
from bench_common import git_commit  # noqa: E402
from sft_cli import SHAPES, chat_overhead_tokens, write_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CAPPED = (
    "import sys, torch\n"
    "cap = float(sys.argv[1]) * 2**30\n"
    "if cap and torch.cuda.is_available():\n"
    "    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / torch.cuda.get_device_properties(0).total_memory))\n"
    "from laden.cli import main\n"
    "sys.exit(main(sys.argv[2:]))\n"
)


def write_model(out: Path, shape: str, max_positions: int) -> None:
    """A random-init checkpoint of `shape` (bf16, built on the GPU when there is one) and a character tokenizer."""
    import torch
    from tiny import build_char_tokenizer
    from transformers import AutoModelForCausalLM, Qwen3Config

    if (out / "model.safetensors").exists() or (out / "model.safetensors.index.json").exists():
        return
    build_char_tokenizer(out)
    config = Qwen3Config(
        **SHAPES[shape], max_position_embeddings=max_positions, pad_token_id=0, eos_token_id=3
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)


def run(work: Path, args: argparse.Namespace, name: str, knobs: list[str]) -> dict:
    overrides = [
        f"experiment_name={name}", f"cluster.fileroot={work / 'runs'}", f"actor.path={work / 'model'}",
        "actor.init_from_config=false", "actor.dtype=bfloat16", f"actor.optimizer.type={args.optimizer}",
        "actor.optimizer.lr=1e-4", "actor.backend=fsdp:d1", f"train_dataset.path={work / 'data.jsonl'}",
        f"train_dataset.max_length={args.seq_len}", f"train_dataset.batch_size={args.batch_size}",
        f"total_train_steps={args.steps}", "checkpoint.save_freq_steps=null", "checkpoint.save_at_end=false",
        "checkpoint.export_hf=false", "checkpoint.resume=never", "oom_policy=raise", *knobs,
    ]  # fmt: skip
    if args.optimizer == "adam_bf16":
        overrides.append("actor.optimizer_dtype=bfloat16")
    cmd = [sys.executable, "-c", CAPPED, str(args.cap_gib), "sft", "--no-progress", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=args.timeout)
    (work / f"{name}.log").write_text(proc.stdout + proc.stderr)
    result: dict = {"name": name, "knobs": knobs, "model": args.model, "seq_len": args.seq_len,
                    "batch_size": args.batch_size, "cap_gib": args.cap_gib, "commit": git_commit()}  # fmt: skip
    chosen = [line.split("INFO ", 1)[-1] for line in proc.stderr.splitlines() if "=auto -> " in line]
    if chosen:
        result["auto"] = chosen
    if proc.returncode != 0:
        text = proc.stdout + proc.stderr
        oom = "out of memory" in text.lower() or "OutOfMemoryError" in text
        return {
            **result,
            "error": "OOM" if oom else text.strip().splitlines()[-1][:400],
            "rc": proc.returncode,
        }
    metrics = work / "runs" / name / "run0" / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if '"tokens_per_s"' in x]
    timed = rows[args.warmup :] or rows
    return {
        **result,
        "tokens_per_s": round(sum(r["tokens_per_s"] for r in timed) / len(timed), 1),
        "peak_gpu_gib": round(max(r.get("peak_gpu_gib", 0.0) for r in rows), 2),
        "last_loss": rows[-1]["loss"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/auto_sweep")
    p.add_argument("--model", default="qwen3-1.7b", choices=sorted(SHAPES))
    p.add_argument("--optimizer", default="adam_bf16", choices=["adam", "adam_bf16"])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--cap-gib", type=float, default=24.0, help="GPU memory cap; 0: none")
    p.add_argument("--budgets", type=int, nargs="*", default=[1, 2, 4, 8], help="token budgets, in sequences")
    p.add_argument(
        "--no-gc-budgets", type=int, nargs="*", default=[1, 2], help="budgets tried without recompute"
    )
    p.add_argument("--timeout", type=int, default=240, help="seconds per run")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    write_model(work / "model", args.model, max(args.seq_len, 128))
    write_dataset(work / "data.jsonl", num_docs=args.batch_size * args.steps, seq_len=args.seq_len,
                  overhead=chat_overhead_tokens(work / "model"))  # fmt: skip
    grid = [(False, k) for k in args.no_gc_budgets] + [(True, k) for k in args.budgets]
    results = []
    for gc, k in grid:
        knobs = [
            f"actor.gradient_checkpointing={str(gc).lower()}",
            f"actor.mb_spec.max_tokens_per_mb={k * args.seq_len}",
        ]
        results.append(run(work, args, f"hand-gc{int(gc)}-x{k}", knobs))
        print(json.dumps(results[-1]), flush=True)
    auto = run(
        work, args, "auto", ["actor.gradient_checkpointing=auto", "actor.mb_spec.max_tokens_per_mb=auto"]
    )
    print(json.dumps(auto), flush=True)
    ran = [r for r in results if "tokens_per_s" in r]
    best = max(ran, key=lambda r: r["tokens_per_s"]) if ran else None
    print(json.dumps({
        "summary": True, "best_hand": best["name"] if best else None,
        "best_hand_tokens_per_s": best["tokens_per_s"] if best else None,
        "auto_tokens_per_s": auto.get("tokens_per_s"), "auto_error": auto.get("error"),
        "auto_over_best": round(auto["tokens_per_s"] / best["tokens_per_s"], 3) if best and "tokens_per_s" in auto else None,
        "hand_set_crashes": [r["name"] for r in results if r.get("error") == "OOM"],
    }), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
