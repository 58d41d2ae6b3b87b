"""Arithmetic problems for RL (reasoning-gym's `basic_arithmetic`), as the jsonl `laden rl` reads.

    pip install reasoning-gym
    python examples/prepare_arith.py runs/arith            # train.jsonl (seed 1) and test.jsonl (seed 2)

Each row is {"prompt": question, "answer": answer, "answer_format": "number"}: the RLVR workflow
chat-templates the prompt and `laden.rl.rewards:math_reward` checks the completion's final answer
against `answer` with math-verify; `answer_format: number` scores only a numeral, so restating the
question ("97 * 81", which math-verify evaluates) earns nothing. The held-out set uses another
seed, so no test problem is a training problem.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SUFFIX = " Give only the final number."


def write(path: Path, *, seed: int, size: int, digits: int) -> int:
    import reasoning_gym

    ds = reasoning_gym.create_dataset(
        "basic_arithmetic", seed=seed, size=size, min_terms=2, max_terms=2, min_digits=1, max_digits=digits
    )
    with path.open("w") as f:
        for entry in ds:
            row = {
                "prompt": entry["question"] + SUFFIX,
                "answer": str(entry["answer"]),
                "answer_format": "number",
            }
            f.write(json.dumps(row) + "\n")
    return size


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--train-size", type=int, default=2048)
    parser.add_argument("--test-size", type=int, default=200)
    parser.add_argument("--digits", type=int, default=2)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    n = write(args.out_dir / "train.jsonl", seed=1, size=args.train_size, digits=args.digits)
    m = write(args.out_dir / "test.jsonl", seed=2, size=args.test_size, digits=args.digits)
    print(json.dumps({"train": n, "test": m, "out_dir": str(args.out_dir)}))


if __name__ == "__main__":
    main()
