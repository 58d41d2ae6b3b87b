"""Greedy accuracy of a model on held-out problems (before and after `laden rl`).

    python examples/eval_arith.py runs/smollm2-135m-instruct runs/arith/test.jsonl
    python examples/eval_arith.py runs/rl-smollm2-arith/run0/hf runs/arith/test.jsonl

Completions come from laden's native engine (greedy, `--max-new-tokens`), scored with
`laden.rl.rewards:math_reward` (math-verify); one JSON line with the accuracy.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("data", type=Path)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from laden.rl.rewards import math_reward
    from laden.rl.workflow import render_prompt
    from laden.rollout import GenerationRequest, SamplingParams
    from laden.rollout.native import NativeEngine

    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()][: args.limit]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).to(device)
    prompts = [render_prompt(row, tok).ids for row in rows]
    engine = NativeEngine(
        model, tok, max_concurrent=min(len(rows), 256), max_model_len=max(map(len, prompts)) + args.max_new_tokens + 8,
        kv_cache_tokens=min(len(rows), 256) * (max(map(len, prompts)) + args.max_new_tokens + 16),
    )  # fmt: skip
    params = SamplingParams(greedy=True, max_new_tokens=args.max_new_tokens)
    results = engine.generate_sync(
        [GenerationRequest(rid=str(i), input_ids=tuple(p), sampling=params) for i, p in enumerate(prompts)]
    )
    correct = 0
    for row, r in zip(rows, results):
        text = tok.decode(r.output_ids, skip_special_tokens=True)
        fields = {k: v for k, v in row.items() if k != "prompt"}
        correct += math_reward(row["prompt"], text, None, r.output_ids, **fields) >= 1
    print(json.dumps({"model": str(args.model_dir), "data": str(args.data), "problems": len(rows),
                      "accuracy": round(correct / len(rows), 4)}))  # fmt: skip


if __name__ == "__main__":
    main()
