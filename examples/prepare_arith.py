"""Arithmetic problems for RL (reasoning-gym's `basic_arithmetic`), as the jsonl `laden rl` reads,
with a held-out set that shares no problem with the training set.

    pip install reasoning-gym
    python examples/prepare_arith.py runs/arith            # train.jsonl and test.jsonl

Each row is {"prompt": question, "answer": answer, "answer_format": "number"}: the RLVR workflow
chat-templates the prompt and `laden.rl.rewards:math_reward` checks the completion's final answer
against `answer` with math-verify; `answer_format: number` scores only a numeral, so restating the
question ("97 * 81", which math-verify evaluates) earns nothing.

Held out means held out. reasoning-gym's generators at nearby seeds give shifted copies of one
sequence (seed 2's first 200 problems were all among seed 1's first 2048), and two terms of at most
two digits is a small space, so another seed alone does not make a test set. The test set is drawn
from a distant seed and every candidate is dropped that matches a training problem by its question
text or by its expression (parsed, so spaces and redundant parentheses go, and the two operands of
`+` and `*` in sorted order: "( 3 + 4 )" and "4 + 3" are one problem) or by the normalised text laden's
own overlap check compares (`laden.data.overlap`, which drops parentheses: "-( 41 / 1 )" and "-41 / 1"),
and duplicates within the test set too. The counts removed are printed; the script fails if a shared problem remains (checked again on the written files).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from laden.data.overlap import normalized

SUFFIX = " Give only the final number."
TRAIN_SEED = 1
TEST_SEED = 1_000_003
"""Far from TRAIN_SEED; overlap is removed all the same (see the module docstring)."""
_EXPRESSION = re.compile(r"[-+*/()\d\s.]*\d[-+*/()\d\s.]*")


def expression_key(question: str) -> str:
    """The arithmetic of a question in a normal form: the longest run of digits and operators, parsed and
    written back without redundant parentheses or spaces; the two operands of one `+` or `*` sorted."""
    runs = [m.group(0) for m in _EXPRESSION.finditer(question)]
    expr = max(runs, key=len, default="").strip().strip(".")
    try:
        tree = ast.parse(expr, mode="eval").body
    except SyntaxError:
        return re.sub(r"\s+", "", expr)
    if isinstance(tree, ast.BinOp) and isinstance(tree.op, (ast.Add, ast.Mult)):
        left, right = sorted((_operand(tree.left), _operand(tree.right)))
        return f"{left}{'+' if isinstance(tree.op, ast.Add) else '*'}{right}".replace(" ", "")
    return ast.unparse(tree).replace(" ", "")


def _operand(node: ast.expr) -> str:
    text = ast.unparse(node)
    return f"({text})" if isinstance(node, ast.BinOp) else text


def rows(entries: Iterable[Mapping[str, Any]]) -> Iterator[dict[str, Any]]:
    """reasoning-gym entries as laden rows."""
    for entry in entries:
        yield {
            "prompt": entry["question"] + SUFFIX,
            "answer": str(entry["answer"]),
            "answer_format": "number",
        }


def disjoint_test(
    train: list[dict[str, Any]], candidates: Iterable[dict[str, Any]], size: int
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The first `size` candidates that share neither question text nor expression with `train` or with
    an earlier kept candidate, and how many were removed for each reason."""
    texts = {r["prompt"] for r in train}
    exprs = {expression_key(r["prompt"]) for r in train}
    loose = {normalized(r["prompt"]) for r in train}
    kept: list[dict[str, Any]] = []
    kept_exprs: set[str] = set()
    removed = {
        "same_question_as_train": 0, "same_expression_as_train": 0, "same_normalised_text_as_train": 0,
        "duplicate_in_test": 0,
    }  # fmt: skip
    for row in candidates:
        if len(kept) == size:
            break
        key = expression_key(row["prompt"])
        if row["prompt"] in texts:
            removed["same_question_as_train"] += 1
        elif key in exprs:
            removed["same_expression_as_train"] += 1
        elif normalized(row["prompt"]) in loose:
            removed["same_normalised_text_as_train"] += 1
        elif key in kept_exprs:
            removed["duplicate_in_test"] += 1
        else:
            kept.append(row)
            kept_exprs.add(key)
    return kept, removed


def shared(train: list[dict[str, Any]], test: list[dict[str, Any]]) -> int:
    """Test rows whose question text, expression or normalised text is a training row's."""
    texts = {r["prompt"] for r in train}
    exprs = {expression_key(r["prompt"]) for r in train}
    loose = {normalized(r["prompt"]) for r in train}
    return sum(
        r["prompt"] in texts or expression_key(r["prompt"]) in exprs or normalized(r["prompt"]) in loose
        for r in test
    )


def generate(seed: int, size: int, digits: int) -> list[dict[str, Any]]:
    import reasoning_gym

    ds = reasoning_gym.create_dataset(
        "basic_arithmetic", seed=seed, size=size, min_terms=2, max_terms=2, min_digits=1, max_digits=digits
    )
    return list(rows(ds))


def write(path: Path, data: list[dict[str, Any]]) -> None:
    with path.open("w") as f:
        for row in data:
            f.write(json.dumps(row) + "\n")


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
    train = generate(TRAIN_SEED, args.train_size, args.digits)
    # candidates: many more than needed, since a large share of a small problem space is in train
    test, removed = disjoint_test(
        train, generate(TEST_SEED, 20 * args.test_size, args.digits), args.test_size
    )
    if len(test) < args.test_size:
        raise SystemExit(
            f"only {len(test)} problems outside the training set could be drawn (removed: {removed}); lower "
            "--train-size or --test-size, or raise --digits"
        )
    write(args.out_dir / "train.jsonl", train)
    write(args.out_dir / "test.jsonl", test)
    on_disk = [
        [json.loads(line) for line in (args.out_dir / f).read_text().splitlines()]
        for f in ("train.jsonl", "test.jsonl")
    ]
    common = shared(*on_disk)
    if common:
        raise SystemExit(f"{common} test problems are training problems after writing; this is a bug")
    print(json.dumps({"train": len(train), "test": len(test), "removed_from_test": removed, "shared": common,
                      "out_dir": str(args.out_dir)}))  # fmt: skip


if __name__ == "__main__":
    main()
