"""Measure `laden sft` end to end on a Qwen3-0.6B-shaped random-init model.

Each variant (gradient checkpointing on/off x chunked cross-entropy on/off) runs the real
CLI in its own process (under torchrun with `--nproc N`), so its peak GPU memory is its own;
its JSON line has every step's loss, so two layouts of one workload can be checked to agree.
`--model qwen3-moe-small` (or `tiny-moe`) is a Qwen3-MoE shape for the archon engine. Data:
synthetic documents of `--seq-len` characters with the local character tokenizer (one token per character), so
every sequence is exactly the requested length. Prints one JSON object per variant.

    python benchmarks/sft_cli.py --seq-len 4096 --batch-size 8 --steps 8
"""

from __future__ import annotations

import argparse
import json
import random
import string
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "tests" / "support"))  # the tiny test model
from bench_common import shapes  # noqa: E402
from moe_train import SHAPES as MOE_SHAPES  # noqa: E402

SHAPES = shapes(
    "qwen3-0.6b",
    "qwen3-1.7b",
    tiny=dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        tie_word_embeddings=False,
    ),
)
MOE = {"qwen3-moe-small": MOE_SHAPES["qwen3-moe-small"], "tiny-moe": MOE_SHAPES["tiny"]}
"""Qwen3-MoE shapes (benchmarks/moe_train.py's), for the archon engine's expert parallel."""


def write_model_dir(out: Path, shape: str, max_positions: int) -> None:
    from tiny import build_char_tokenizer
    from transformers import Qwen3Config, Qwen3MoeConfig

    build_char_tokenizer(out)
    kind, dims = (Qwen3MoeConfig, MOE[shape]) if shape in MOE else (Qwen3Config, SHAPES[shape])
    kind(**dims, max_position_embeddings=max_positions, pad_token_id=0, eos_token_id=3).save_pretrained(out)


def chat_overhead_tokens(model_dir: Path) -> int:
    """Tokens the chat template adds around an empty prompt and completion."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    msgs = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]
    return len(tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"])


def write_dataset(path: Path, *, num_docs: int, seq_len: int, overhead: int, seed: int = 0) -> None:
    """Prompt/completion records whose chat rendering is `seq_len` tokens (chars) long."""
    rng = random.Random(seed)
    alphabet = string.ascii_lowercase + " "
    body = seq_len - overhead
    with path.open("w") as f:
        for _ in range(num_docs):
            text = "".join(rng.choice(alphabet) for _ in range(body))
            f.write(json.dumps({"prompt": text[: body // 4], "completion": text[body // 4 :]}) + "\n")


def run_variant(work: Path, args, *, gc: bool, chunked: bool) -> dict:
    name = f"sft-{args.model}-{args.backend.replace(':', '-')}-gc{int(gc)}-chunked{int(chunked)}"
    overrides = [
        f"actor.backend={args.backend}",
        f"cluster.n_gpus_per_node={max(args.nproc, 1)}",
        f"experiment_name={name}",
        f"cluster.fileroot={work / 'runs'}",
        f"actor.path={work / 'model'}",
        "actor.init_from_config=true",
        f"actor.dtype={args.dtype}",
        f"actor.gradient_checkpointing={str(gc).lower()}",
        f"actor.chunked_loss={str(chunked).lower()}",
        f"actor.mb_spec.max_tokens_per_mb={args.tokens_per_mb}",
        f"train_dataset.path={work / 'data.jsonl'}",
        f"train_dataset.max_length={args.seq_len}",
        f"train_dataset.batch_size={args.batch_size}",
        f"total_train_steps={args.steps}",
        "checkpoint.save_freq_steps=null",
        "checkpoint.export_hf=false",
        "actor.optimizer.lr=1e-4",
    ]
    launcher = [sys.executable, "-m", "laden.cli"]
    if args.nproc > 1:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={args.nproc}",
            "-m",
            "laden.cli",
        ]
    cmd = [*launcher, "sft", "--no-progress", *overrides, *args.extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    result = {
        "name": name,
        "model": args.model,
        "backend": args.backend,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
    }
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-1500:]
        return {**result, "error": "OOM" if "out of memory" in tail.lower() else tail}
    rows = [json.loads(x) for x in (work / "runs" / name / "run0" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]  # training steps (a held-out evaluation's row has none)
    timed = rows[args.warmup :]
    tokens_per_s = sum(r["tokens_per_s"] for r in timed) / len(timed)
    return {
        **result,
        "tokens_per_s": round(tokens_per_s, 1),
        "peak_gpu_gib": round(max(r.get("peak_gpu_gib", 0.0) for r in rows), 2),
        "peak_host_gib": round(max(r.get("peak_host_gib", 0.0) for r in rows), 2),
        "first_loss": rows[0]["loss"],
        "last_loss": rows[-1]["loss"],
        "losses": [r["loss"] for r in rows],
        "nproc": args.nproc,
        **{key: [round(max(r[key][i] for r in rows), 2) for i in range(args.nproc)]
           for key in ("peak_gpu_gib_ranks", "peak_host_gib_ranks") if key in rows[0]},
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="qwen3-0.6b", choices=sorted([*SHAPES, *MOE]))
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--tokens-per-mb", type=int, default=0, help="0 = one sequence per micro-batch")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--variants", default="00,01,10,11", help="gc,chunked bit pairs")
    p.add_argument("--backend", default="fsdp:d1", help="actor.backend")
    p.add_argument("--nproc", type=int, default=1, help="processes (torchrun) for the backend")
    p.add_argument("--extra", nargs="*", default=[], help="more dotted overrides")
    args = p.parse_args()
    args.tokens_per_mb = args.tokens_per_mb or args.seq_len
    import torch
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__}
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_model_dir(work / "model", args.model, max(args.seq_len, 4096))
        write_dataset(
            work / "data.jsonl",
            num_docs=args.batch_size * (args.steps + 1),
            seq_len=args.seq_len,
            overhead=chat_overhead_tokens(work / "model"),
        )
        for v in args.variants.split(","):
            res = run_variant(work, args, gc=v[0] == "1", chunked=v[1] == "1")
            print(json.dumps({**res, **env}), flush=True)


if __name__ == "__main__":
    main()
