"""The native engine's kernel options worth running with, from the `options` part's results.

    python benchmarks/pick_options.py OUT/options.jsonl [--union] [--min-gain 0.01]

The input is `generate_throughput.py`'s JSON lines for one workload and batch: runs with the
defaults (no `kernel_options`) and runs with `--kernel-option` (recorded as `kernel_options`).
Prints the picked options as `MODULE.NAME=VALUE` words on one line, ready for
`--kernel-option`; an empty line means the defaults. Why each was picked or not goes to stderr.

- Without `--union`: the options of the fastest measured run, when it beats the defaults' mean by
  at least `--min-gain` (run-to-run noise is about 1%); otherwise nothing.
- `--union`: every option whose run beat the defaults by `--min-gain`, together, for a run that
  measures them together (two winners that set the same name to different values: the faster's);
  nothing when that set was measured already (one winner, or none).

Exit status 1 when no run with the defaults succeeded (nothing to compare against).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

Options = dict[str, Any]


def results(lines: list[str], workload: str | None, batch: int | None) -> list[tuple[Options, float]]:
    """(options, output tokens/s) of each successful native run of the workload and batch."""
    out = []
    for line in lines:
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        if record.get("system") != "native" or "output_tokens_per_s" not in record:
            continue
        if workload is not None and record.get("workload") != workload:
            continue
        if batch is not None and record.get("batch") != batch:
            continue
        out.append((dict(record.get("kernel_options") or {}), float(record["output_tokens_per_s"])))
    return out


def words(options: Options) -> str:
    """`--kernel-option`'s words for `options` (strings bare: `kernel_options_from` reads them back)."""
    return " ".join(f"{k}={v if isinstance(v, str) else repr(v)}" for k, v in sorted(options.items()))


def baseline(runs: list[tuple[Options, float]]) -> float:
    speeds = [speed for options, speed in runs if not options]
    if not speeds:
        raise ValueError("no successful run with the defaults to compare against")
    return sum(speeds) / len(speeds)


def pick(runs: list[tuple[Options, float]], min_gain: float) -> tuple[Options, list[str]]:
    """The fastest run's options when it beats the defaults by `min_gain`, and the reasons."""
    base = baseline(runs)
    notes = [f"defaults: {base:,.0f} tok/s (mean of {sum(1 for o, _ in runs if not o)})"]
    best: tuple[Options, float] = ({}, base)
    for options, speed in runs:
        if options:
            notes.append(f"{words(options)}: {speed:,.0f} tok/s ({speed / base - 1:+.1%})")
            if speed > best[1]:
                best = (options, speed)
    if best[0] and best[1] >= base * (1 + min_gain):
        notes.append(f"picked {words(best[0])}")
        return best[0], notes
    notes.append(f"picked the defaults (nothing beat them by {min_gain:.1%})")
    return {}, notes


def union(runs: list[tuple[Options, float]], min_gain: float) -> tuple[Options, list[str]]:
    """Every option that beat the defaults by `min_gain` alone, together (faster first on a clash)."""
    base = baseline(runs)
    winners = sorted(
        ((o, s) for o, s in runs if o and s >= base * (1 + min_gain)), key=lambda run: run[1], reverse=True
    )
    together: Options = {}
    notes = []
    for options, speed in winners:
        clash = [k for k, v in options.items() if k in together and together[k] != v]
        if clash:
            notes.append(
                f"left out {words(options)} ({speed:,.0f} tok/s): a faster one sets {', '.join(clash)}"
            )
            continue
        together.update(options)
    if any(options == together for options, _ in runs):
        notes.append(f"together: {words(together) or 'the defaults'}, measured already")
        return {}, notes
    notes.append(f"together, to measure: {words(together)}")
    return together, notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, help="generate_throughput.py's JSON lines (the options part's)")
    ap.add_argument("--workload", default="A")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--min-gain", type=float, default=0.01, help="least gain over the defaults (0.01: 1%%)")
    ap.add_argument(
        "--union", action="store_true", help="every winning option together, for a run to measure"
    )
    args = ap.parse_args(argv)
    lines = args.results.read_text().splitlines() if args.results.is_file() else []  # no run finished
    runs = results(lines, args.workload, args.batch)
    try:
        options, notes = (union if args.union else pick)(runs, args.min_gain)
    except ValueError as e:
        print(f"pick_options: {args.results}: {e}", file=sys.stderr)
        return 1
    for note in notes:
        print(f"pick_options: {note}", file=sys.stderr)
    print(words(options))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
