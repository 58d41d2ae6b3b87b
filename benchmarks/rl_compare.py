"""Two or more RL runs side by side: wall-clock time to the same reward and to the same held-out
accuracy, one JSON line a run.

    python benchmarks/rl_compare.py runs/rl-x/k0 runs/rl-x/k4 [--window 5] [--target 0.6] \
        [--accuracy k0=0.41 k4=0.42]

Each argument is a run directory (or its `metrics.jsonl`): `laden rl`'s, or any run that writes
rows of the same names (`benchmarks/trl_grpo.py` for TRL). A run's reward curve is the moving mean
of `reward_mean` over `--window` steps. Its time axis is `elapsed_s`, the training loop's seconds
at the end of each step (evaluations left out). The target is `--target`, or else the highest
smoothed reward that every run reaches (the "same reward"). Each run's line has the first step and
`elapsed_s` at which its curve reaches the target.

Held-out accuracy (the `eval/accuracy` rows, `laden rl`'s evaluation on `valid_dataset`): the
target is the best accuracy the weakest run reaches, and each run's line has when it first reached
it (`seconds_to_accuracy`). Final accuracy is the last `eval/accuracy`, else the held-out figure
given with `--accuracy LABEL=VALUE` (from `laden eval`), else the mean training `accuracy` of the
last `--window` steps (say which: `final_accuracy_source`). The last line compares the runs:
`speedup` (and `speedup_accuracy`) is the first run's time over each other run's, so list the
reference (TRL, or the synchronous run) first; `accuracy_gap` is each run's final accuracy minus
the first run's.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any


def load(path: Path) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl; `path` is the run directory or the file itself."""
    file = path / "metrics.jsonl" if path.is_dir() else path
    rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    if not any("reward_mean" in r for r in rows):
        raise SystemExit(f"{file}: no logged steps")
    if "elapsed_s" not in rows[-1]:
        raise SystemExit(
            f"{file}: rows have no elapsed_s (written by laden rl from 2026-12-04 on): rerun the run"
        )
    return rows


def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing moving mean: entry i is the mean of values[max(0, i - window + 1) : i + 1]."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def time_to(rows: list[dict[str, Any]], curve: list[float], target: float) -> tuple[int, float] | None:
    """(step, elapsed_s) of the first step whose smoothed reward (`curve`, one value a row) reaches
    `target`, or None."""
    for row, value in zip(rows, curve):
        if value >= target:
            return int(row["step"]), float(row["elapsed_s"])
    return None


def compare(runs: dict[str, list[dict[str, Any]]], *, window: int, target: float | None = None,
            accuracy: dict[str, float] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """One record per run, then the summary (see the module docstring)."""
    train = {label: [r for r in rows if "reward_mean" in r] for label, rows in runs.items()}
    evals = {label: [r for r in rows if "eval/accuracy" in r] for label, rows in runs.items()}
    curves = {
        label: smoothed([float(r["reward_mean"]) for r in rows], window) for label, rows in train.items()
    }
    same = min(max(curve) for curve in curves.values()) if target is None else target
    held_out = all(evals.values())
    same_acc = min(max(float(r["eval/accuracy"]) for r in e) for e in evals.values()) if held_out else None
    records: list[dict[str, Any]] = []
    for label, rows in train.items():
        hit = time_to(rows, curves[label], same)
        acc, source = (accuracy or {}).get(label), "--accuracy"
        if evals[label]:
            acc, source = float(evals[label][-1]["eval/accuracy"]), "eval/accuracy"
        elif acc is None:
            tail = [float(r["accuracy"]) for r in rows[-window:] if "accuracy" in r]
            acc, source = (sum(tail) / len(tail) if tail else math.nan), "training accuracy"
        record = {
            "bench": "rl_compare", "label": label, "steps": len(rows), "target_reward": round(same, 4),
            "step_to_target": hit[0] if hit else None, "seconds_to_target": round(hit[1], 2) if hit else None,
            "total_s": rows[-1]["elapsed_s"], "reward_last": round(curves[label][-1], 4),
            "final_accuracy": round(acc, 4), "final_accuracy_source": source,
        }  # fmt: skip
        if same_acc is not None:
            reached = next((r for r in evals[label] if float(r["eval/accuracy"]) >= same_acc), None)
            record.update(
                target_accuracy=round(same_acc, 4), step_to_accuracy=None if reached is None else reached["step"],
                seconds_to_accuracy=None if reached is None else round(float(reached["elapsed_s"]), 2),
            )  # fmt: skip
        records.append(record)
    first = records[0]
    summary: dict[str, Any] = {"bench": "rl_compare", "summary": True, "reference": first["label"],
                               "target_reward": round(same, 4), "window": window}  # fmt: skip
    if same_acc is not None:
        summary["target_accuracy"] = round(same_acc, 4)
    for rec in records[1:]:
        a, b = first["seconds_to_target"], rec["seconds_to_target"]
        summary[f"speedup_{rec['label']}"] = round(a / b, 3) if a and b else None
        if same_acc is not None:
            a, b = first["seconds_to_accuracy"], rec["seconds_to_accuracy"]
            summary[f"speedup_accuracy_{rec['label']}"] = round(a / b, 3) if a and b else None
        summary[f"accuracy_gap_{rec['label']}"] = round(rec["final_accuracy"] - first["final_accuracy"], 4)
    return [*records, summary]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "runs", nargs="+", type=Path, help="run directories (or metrics.jsonl), the reference first"
    )
    p.add_argument("--labels", nargs="*", default=None, help="one per run (default: the directory names)")
    p.add_argument("--window", type=int, default=5, help="steps in the reward's moving mean")
    p.add_argument(
        "--target", type=float, default=None, help="reward to reach (default: the highest all reach)"
    )
    p.add_argument("--accuracy", nargs="*", default=[], help="LABEL=VALUE held-out final accuracies")
    p.add_argument(
        "--plot", type=Path, default=None, help="draw reward and held-out accuracy against seconds (PNG)"
    )
    args = p.parse_args(argv)
    if args.window < 1:
        p.error(f"--window {args.window}: must be at least 1")
    labels = args.labels or [(r if r.is_dir() else r.parent).name for r in args.runs]
    if len(labels) != len(args.runs) or len(set(labels)) != len(labels):
        p.error(f"--labels {labels}: need one distinct label per run ({len(args.runs)} runs)")
    accuracy = {}
    for item in args.accuracy:
        label, _, value = item.partition("=")
        if label not in labels or not value:
            p.error(f"--accuracy {item!r}: expected LABEL=VALUE with LABEL one of {labels}")
        accuracy[label] = float(value)
    runs = {label: load(path) for label, path in zip(labels, args.runs)}
    for record in compare(runs, window=args.window, target=args.target, accuracy=accuracy):
        print(json.dumps(record), flush=True)
    if args.plot is not None:
        plot(runs, args.plot, window=args.window)


def plot(runs: dict[str, list[dict[str, Any]]], path: Path, *, window: int) -> None:
    """Training reward (moving mean) and held-out accuracy of every run against `elapsed_s`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    reward_ax, acc_ax = fig.subplots(1, 2)
    for label, rows in runs.items():
        train = [r for r in rows if "reward_mean" in r]
        reward_ax.plot([r["elapsed_s"] for r in train], smoothed([float(r["reward_mean"]) for r in train], window),
                       label=label)  # fmt: skip
        evals = [r for r in rows if "eval/accuracy" in r]
        acc_ax.plot(
            [r["elapsed_s"] for r in evals], [r["eval/accuracy"] for r in evals], marker="o", label=label
        )
    reward_ax.set(xlabel="training seconds", ylabel=f"training reward (mean of {window} steps)")
    acc_ax.set(xlabel="training seconds", ylabel="held-out accuracy")
    for ax in (reward_ax, acc_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
