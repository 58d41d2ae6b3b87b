"""The planner's accuracy: `laden plan --profile` over a sweep of configs, predicted vs measured peaks.

Each configuration runs in a process of its own (`laden plan --config ... --profile --json ...`), so
its GPU and host peaks are its own: the training configurations of both engines on the Qwen3-0.6B
and 1.7B shapes (sequence 2K to 32K, recompute on and off, stage and layer grain, chunked and full
logits), then the generation configurations (batch and length, the native engine beside an fsdp
trainer) one at a time, since the engine sizes its KV cache from the GPU's free memory. Training
configurations run `--parallel` at a time (their peaks are per process; the roundpipe engine's
stage plan reads the GPU's total, not its free memory).

One JSON line per configuration on stdout (predicted and measured bytes per phase, the errors),
then a summary line: how many phases are within the targets (GPU 10%, host 15%, or 64 MiB where
both sides are that small).

    python benchmarks/plan_accuracy.py --work /tmp/plan_acc                  # the whole sweep (H200)
    python benchmarks/plan_accuracy.py --work /tmp/plan_acc --only fsdp-0.6b-2k --shapes tiny   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import QWEN3_SHAPES, git_commit  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "laden" / "assets"
GPU_TARGET, HOST_TARGET = 0.10, 0.15
SMALL = 64 * 2**20
"""Peaks this close count as met whatever their ratio (the native engine's host side: 0 predicted, 0 to 30 MiB measured)."""

K = 1024
# name: (shape, job, overrides)
TRAINING: dict[str, tuple[str, list[str]]] = {
    "fsdp-0.6b-2k": ("qwen3-0.6b", ["actor.backend=fsdp:d1", "train_dataset.max_length=2048", "actor.mb_spec.max_tokens_per_mb=8192", "actor.gradient_checkpointing=false"]),
    "fsdp-0.6b-8k-gc": ("qwen3-0.6b", ["actor.backend=fsdp:d1", "train_dataset.max_length=8192", "actor.mb_spec.max_tokens_per_mb=8192", "actor.gradient_checkpointing=true"]),
    "fsdp-0.6b-4k-full-logits": ("qwen3-0.6b", ["actor.backend=fsdp:d1", "train_dataset.max_length=4096", "actor.mb_spec.max_tokens_per_mb=4096", "actor.gradient_checkpointing=false", "actor.chunked_loss=false"]),
    "fsdp-1.7b-2k": ("qwen3-1.7b", ["actor.backend=fsdp:d1", "train_dataset.max_length=2048", "actor.mb_spec.max_tokens_per_mb=8192", "actor.gradient_checkpointing=false"]),
    "fsdp-1.7b-16k-gc": ("qwen3-1.7b", ["actor.backend=fsdp:d1", "train_dataset.max_length=16384", "actor.mb_spec.max_tokens_per_mb=16384", "actor.gradient_checkpointing=true"]),
    "fsdp-1.7b-32k-gc": ("qwen3-1.7b", ["actor.backend=fsdp:d1", "train_dataset.max_length=32768", "actor.mb_spec.max_tokens_per_mb=32768", "actor.gradient_checkpointing=true"]),
    "roundpipe-0.6b-2k": ("qwen3-0.6b", ["actor.backend=roundpipe:d1", "train_dataset.max_length=2048", "actor.mb_spec.max_tokens_per_mb=8192", "actor.roundpipe.num_microbatch=2"]),
    "roundpipe-0.6b-8k-layer": ("qwen3-0.6b", ["actor.backend=roundpipe:d1", "train_dataset.max_length=8192", "actor.mb_spec.max_tokens_per_mb=8192", "actor.roundpipe.recompute_grain=layer", "actor.roundpipe.model_memory_limit=4"]),
    "roundpipe-0.6b-4k-full-logits": ("qwen3-0.6b", ["actor.backend=roundpipe:d1", "train_dataset.max_length=4096", "actor.mb_spec.max_tokens_per_mb=4096", "actor.chunked_loss=false", "actor.roundpipe.model_memory_limit=6"]),
    "roundpipe-1.7b-4k-limit8": ("qwen3-1.7b", ["actor.backend=roundpipe:d1", "train_dataset.max_length=4096", "actor.mb_spec.max_tokens_per_mb=16384", "actor.roundpipe.model_memory_limit=8", "actor.roundpipe.num_microbatch=2"]),
    "roundpipe-1.7b-16k-layer": ("qwen3-1.7b", ["actor.backend=roundpipe:d1", "train_dataset.max_length=16384", "actor.mb_spec.max_tokens_per_mb=16384", "actor.roundpipe.recompute_grain=layer", "actor.roundpipe.model_memory_limit=8"]),
    "roundpipe-1.7b-32k": ("qwen3-1.7b", ["actor.backend=roundpipe:d1", "train_dataset.max_length=32768", "actor.mb_spec.max_tokens_per_mb=32768", "actor.roundpipe.model_memory_limit=16"]),
    # held out: measured after the estimators were last changed, not used to choose them
    "fsdp-0.6b-16k-gc-full-logits": ("qwen3-0.6b", ["actor.backend=fsdp:d1", "train_dataset.max_length=16384", "actor.mb_spec.max_tokens_per_mb=16384", "actor.gradient_checkpointing=true", "actor.chunked_loss=false"]),
    "fsdp-1.7b-4k": ("qwen3-1.7b", ["actor.backend=fsdp:d1", "train_dataset.max_length=4096", "actor.mb_spec.max_tokens_per_mb=4096", "actor.gradient_checkpointing=false"]),
    "roundpipe-0.6b-16k-limit8": ("qwen3-0.6b", ["actor.backend=roundpipe:d1", "train_dataset.max_length=16384", "actor.mb_spec.max_tokens_per_mb=16384", "actor.roundpipe.model_memory_limit=8"]),
    "roundpipe-1.7b-8k-layer-full-logits": ("qwen3-1.7b", ["actor.backend=roundpipe:d1", "train_dataset.max_length=8192", "actor.mb_spec.max_tokens_per_mb=8192", "actor.roundpipe.recompute_grain=layer", "actor.chunked_loss=false", "actor.roundpipe.model_memory_limit=10"]),
}  # fmt: skip
HELD_OUT = (
    "fsdp-0.6b-16k-gc-full-logits",
    "fsdp-1.7b-4k",
    "roundpipe-0.6b-16k-limit8",
    "roundpipe-1.7b-8k-layer-full-logits",
)
GENERATION: dict[str, tuple[str, list[str]]] = {
    "native-0.6b-b64-1k": ("qwen3-0.6b", ["rollout.max_concurrent_rollouts=64", "train_dataset.max_length=512", "gconfig.max_new_tokens=512"]),
    "native-0.6b-b256-1k": ("qwen3-0.6b", ["rollout.max_concurrent_rollouts=256", "train_dataset.max_length=128", "gconfig.max_new_tokens=1024"]),
    "native-0.6b-b128-4k-frac0.5": ("qwen3-0.6b", ["rollout.max_concurrent_rollouts=128", "train_dataset.max_length=2048", "gconfig.max_new_tokens=2048", "native.mem_fraction_static=0.5"]),
    "native-1.7b-b64-2k": ("qwen3-1.7b", ["rollout.max_concurrent_rollouts=64", "train_dataset.max_length=1024", "gconfig.max_new_tokens=1024"]),
}  # fmt: skip
COMMON = [
    "actor.dtype=bfloat16",
    "actor.optimizer_dtype=float32",
    "actor.init_from_config=false",
    "checkpoint.resume=never",
]
GEN_COMMON = [
    "actor.backend=fsdp:d1",
    "actor.gradient_checkpointing=true",
    "actor.mb_spec.max_tokens_per_mb=4096",
    "gconfig.n_samples=1",
]


def model_dir(work: Path, shape: str) -> Path:
    """A random-init checkpoint of `shape` in bf16 (built on the GPU when there is one), written once,
    with the tiny example's tokenizer (the profile samples random token ids; stop strings are unused)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    out = work / shape
    if not (out / "model.safetensors").exists() and not (out / "model.safetensors.index.json").exists():
        dims = QWEN3_SHAPES.get(shape, TINY)
        torch.manual_seed(0)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(Qwen3Config(**dims), dtype=torch.bfloat16)
        model.save_pretrained(out)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(ASSETS / "tiny" / name, out / name)
        del model
    return out


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512, tie_word_embeddings=True)  # fmt: skip


def run_one(
    name: str, job: str, path: Path, overrides: list[str], work: Path, timeout: int
) -> dict[str, Any]:
    base = ASSETS / ("rl_tiny.yaml" if job == "rl" else "sft_tiny.yaml")
    out = work / f"{name}.json"
    cmd = [sys.executable, "-m", "laden.cli", "plan", "--config", str(base), "--job", job, "--profile",
           "--json", str(out), f"actor.path={path}", f"trial_name={name}", f"cluster.fileroot={work / 'runs'}",
           *COMMON, *overrides]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    record: dict[str, Any] = {"config": name, "job": job, "held_out": name in HELD_OUT, "overrides": overrides, "rc": proc.returncode,
                              "wall_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
    (work / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if out.exists():
        plan = json.loads(out.read_text())
        record["phases"] = [
            {k: p.get(k) for k in ("phase", "engine", "predicted_gpu", "predicted_host", "gpu_error", "host_error", "measured")}
            for p in plan["phases"]
        ]  # fmt: skip
        record["components"] = {p["phase"]: p["components"] for p in plan["phases"]}
    else:
        record["error"] = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return record


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--work", default="/tmp/plan_accuracy", help="model directories, plans and logs")
    parser.add_argument("--only", nargs="*", default=None, help="configuration names (default: all)")
    parser.add_argument("--parallel", type=int, default=2, help="training configurations at a time")
    parser.add_argument("--shapes", choices=["qwen3", "tiny"], default="qwen3", help="tiny: a CPU smoke run")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per configuration")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    picked = lambda table: {k: v for k, v in table.items() if args.only is None or k in args.only}  # noqa: E731
    training, generation = picked(TRAINING), picked(GENERATION)
    dirs = {}
    for shape, _ in [*training.values(), *generation.values()]:
        key = "tiny" if args.shapes == "tiny" else shape
        dirs[shape] = model_dir(work, key)
    records: list[dict[str, Any]] = []

    def emit(record: dict[str, Any]) -> None:
        record["commit"] = git_commit()
        print(json.dumps(record), flush=True)
        records.append(record)

    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        futures = [
            pool.submit(run_one, n, "sft", dirs[s], o, work, args.timeout) for n, (s, o) in training.items()
        ]
        for f in futures:
            emit(f.result())
    for n, (s, o) in generation.items():
        emit(run_one(n, "rl", dirs[s], [*GEN_COMMON, *o], work, args.timeout))
    within = {"gpu": [0, 0], "host": [0, 0]}
    for r in records:
        for p in r.get("phases", []):
            wanted = ("training",) if r["job"] == "sft" else ("generation",)
            if p["phase"] not in wanted:
                continue
            for side, target in (("gpu", GPU_TARGET), ("host", HOST_TARGET)):
                measured = (p["measured"] or {}).get(side)
                if measured is None:
                    continue
                predicted = p[f"predicted_{side}"]
                within[side][1] += 1
                within[side][0] += abs(predicted - measured) <= max(target * measured, SMALL)
    print(json.dumps({"summary": True, "gpu_within_10pct": within["gpu"], "host_within_15pct": within["host"],
                      "configs": len(records), "failed": [r["config"] for r in records if r["rc"] != 0]}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
