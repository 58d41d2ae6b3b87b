"""The figures of issue [5]'s closing note from `run_core_h200.sh`'s JSON lines: best of each
system, every sweep point, and the ratios within one device command.

    python3 benchmarks/core_summary.py OUT/old_new.jsonl OUT/resident.jsonl ... > OUT/summary.json

One JSON object per input file (one device command's part; ratios are only taken within a
file, since machines are shared and noisy), on one line each. Runs are grouped by the prefix of
their `run` name (`GROUPS`); a group's `best` is its fastest valid run, `mean` the mean of its
valid runs (what the old-against-new check compares: repeated runs of one setting, not a
sweep), and `points` lists every run with its tokens/s or why it has none (a sweep point that
ran out of memory is reported, not dropped). Standard library only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

GROUPS = (  # (group, run-name prefix), first match wins
    ("old", "old_ref"),
    ("new", "new_ref"),
    ("fsdp", "fsdp_"),
    ("plain", "plain_"),
    ("laden_sync", "laden_sync"),
    ("laden_async", "laden_async"),
    ("roundpipe", "rp_"),
    ("deepspeed", "ds_"),
)
RATIOS = (  # (name, numerator group, denominator group, statistic)
    ("new_over_old", "new", "old", "mean"),
    ("fsdp_over_laden_sync", "fsdp", "laden_sync", "best"),
    ("fsdp_over_laden_async", "fsdp", "laden_async", "best"),
    ("fsdp_over_plain", "fsdp", "plain", "best"),
    ("laden_sync_over_plain", "laden_sync", "plain", "best"),
    ("laden_async_over_plain", "laden_async", "plain", "best"),
    ("laden_sync_over_roundpipe", "laden_sync", "roundpipe", "best"),
    ("laden_async_over_roundpipe", "laden_async", "roundpipe", "best"),
    ("laden_sync_over_deepspeed", "laden_sync", "deepspeed", "best"),
)
REGRESSION_TOLERANCE = 0.03  # issue [5]: within 3% of the commit before it


def group_of(run: str) -> str | None:
    return next((group for group, prefix in GROUPS if run.startswith(prefix)), None)


def point(result: dict[str, Any]) -> dict[str, Any]:
    """One run as the summary lists it."""
    shape = result.get("shape") or {}
    out = {
        "run": result.get("run"),
        "tokens_per_s": result.get("tokens_per_s") if result.get("valid") else None,
    }
    for key in ("mode", "mfu", "hfu", "hfu_8n", "step_s", "peak_gpu_allocated_gib", "peak_gpu_reserved_gib",
                "peak_host_gib", "engine", "alloc_conf", "last_loss"):  # fmt: skip
        if result.get(key) is not None:
            out[key] = result[key]
    for key in (
        "num_microbatch",
        "gradient_checkpointing",
        "model_memory_limit",
        "model_memory_limit_gb",
        "model_memory_limit_gib",
    ):
        if shape.get(key) is not None:
            out[key] = shape[key]
    if not result.get("valid"):
        out["error_kind"] = result.get("error_kind") or "invalid"
        out["error"] = str(result.get("error") or result.get("problems"))[:300]
    return out


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Groups, their best and mean tokens/s, and the ratios between groups (see the module docstring)."""
    groups: dict[str, dict[str, Any]] = {}
    for result in results:
        group = group_of(str(result.get("run", "")))
        if group is None:
            continue
        entry = groups.setdefault(group, {"points": []})
        entry["points"].append(point(result))
    for entry in groups.values():
        valid = [p for p in entry["points"] if p["tokens_per_s"] is not None]
        entry["valid_runs"] = len(valid)
        entry["best"] = max(valid, key=lambda p: p["tokens_per_s"]) if valid else None
        entry["mean_tokens_per_s"] = (
            round(sum(p["tokens_per_s"] for p in valid) / len(valid), 1) if valid else None
        )
    ratios: dict[str, float] = {}
    for name, num, den, stat in RATIOS:
        a, b = _stat(groups.get(num), stat), _stat(groups.get(den), stat)
        if a is not None and b:
            ratios[name] = round(a / b, 4)
    out: dict[str, Any] = {"groups": groups, "ratios": ratios}
    if "new_over_old" in ratios:
        out["pair_ratios_new_over_old"] = pair_ratios(results)
        out["regression"] = ratios["new_over_old"] < 1 - REGRESSION_TOLERANCE
    return out


def _stat(entry: dict[str, Any] | None, stat: str) -> float | None:
    if not entry:
        return None
    if stat == "mean":
        return entry["mean_tokens_per_s"]
    return entry["best"]["tokens_per_s"] if entry["best"] else None


def pair_ratios(results: list[dict[str, Any]]) -> list[float]:
    """new / old of each pair of runs with the same number (`old_ref_2` and `new_ref_2`)."""
    speeds: dict[str, dict[str, float]] = {"old": {}, "new": {}}
    for r in results:
        run, group = str(r.get("run", "")), group_of(str(r.get("run", "")))
        if group in speeds and r.get("valid") and r.get("tokens_per_s"):
            speeds[group][run.rsplit("_", 1)[-1]] = r["tokens_per_s"]
    common = sorted(set(speeds["old"]) & set(speeds["new"]))
    return [round(speeds["new"][k] / speeds["old"][k], 4) for k in common]


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    out = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def describe(part: str, summary: dict[str, Any]) -> list[str]:
    """Human-readable lines: each group's points, its best, the ratios."""
    lines = []
    for group, entry in summary["groups"].items():
        for p in entry["points"]:
            speed = f"{p['tokens_per_s']:,.0f} tok/s" if p["tokens_per_s"] is not None else p["error_kind"]
            knobs = " ".join(f"{k}={p[k]}" for k in ("num_microbatch", "gradient_checkpointing",
                                                     "model_memory_limit", "model_memory_limit_gb",
                                                     "model_memory_limit_gib") if k in p)  # fmt: skip
            lines.append(f"[{part}] {group:12s} {p['run']:28s} {speed:>16s}  {p.get('mode', '')} {knobs}")
        best = entry["best"]
        if best:
            lines.append(f"[{part}] {group:12s} best: {best['run']} {best['tokens_per_s']:,.0f} tok/s "
                         f"(mean of {entry['valid_runs']}: {entry['mean_tokens_per_s']:,.0f})")  # fmt: skip
    for name, value in summary["ratios"].items():
        lines.append(f"[{part}] ratio {name}: {value:.3f}")
    if "regression" in summary:
        lines.append(f"[{part}] pairs new/old: {summary['pair_ratios_new_over_old']}; "
                     f"regression (> {REGRESSION_TOLERANCE:.0%} slower): {summary['regression']}")  # fmt: skip
    return lines


def main(argv: list[str]) -> int:
    for path in argv:
        part = Path(path).stem
        summary = {"part": part, **summarize(read_jsonl(path))}
        print(json.dumps(summary), flush=True)
        for line in describe(part, summary):
            print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
