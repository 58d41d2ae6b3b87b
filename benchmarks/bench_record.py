"""One JSON line per benchmark run, for the device drivers (`bench_lib.sh`'s `run`).

    python3 benchmarks/bench_record.py NAME RC LIMIT_S WALL_S LOG CMD... >> results.jsonl

Reads the run's output (`LOG.out`, `LOG.err`), keeps the last JSON object it printed with a
`valid` key (the script's own result) or, when there is none, builds an error line from the
output and the exit status, classified as `error_kind`: skipped (not run: too little time left
before the deadline, or `$SKIP_REASON`), timeout, gpu_oom, host_oom (a SIGKILL without a timeout: the kernel's OOM
killer), error. Adds `run`, `cmd`, `rc`, `wall_s`, `limit_s`; prints a one-line summary on
stderr; exits 0 iff the result is valid. Standard library only.
"""

from __future__ import annotations

import json
import os
import sys


def read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def last_result(out: str) -> dict | None:
    """The last JSON object on its own line with a `valid` key (a script's result line)."""
    result = None
    for line in out.splitlines():
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and "valid" in obj:
                result = obj
    return result


def classify(rc: str, limit_s: int, wall_s: int, out: str, err: str) -> tuple[str, str]:
    """(error_kind, message) of a run that printed no valid result."""
    if rc == "skipped":
        return "skipped", os.environ.get("SKIP_REASON") or f"not run: {limit_s} s left before the deadline"
    if rc == "124" or (rc == "137" and wall_s >= limit_s):
        return "timeout", f"no result within {limit_s} s"
    low = (out + err).lower()
    if "out of memory" in low or "out of gpu memory" in low or "outofmemoryerror" in low:
        kind = "gpu_oom"
    elif (
        rc == "137" or "memoryerror" in low or "cannot allocate memory" in low or "out of host memory" in low
    ):
        kind = "host_oom"  # SIGKILL without a timeout: the kernel's OOM killer
    else:
        kind = "error"
    tail = [ln.strip() for ln in (err + out).splitlines() if ln.strip()][-3:]
    return kind, f"exit status {rc}: " + " | ".join(tail)


def record(name: str, rc: str, limit_s: int, wall_s: int, out: str, err: str, cmd: list[str]) -> dict:
    """The JSON line of one run (see the module docstring)."""
    result = last_result(out)
    timed_out = rc == "124" or (rc == "137" and wall_s >= limit_s)
    if result is None or (not result.get("valid") and (timed_out or "error_kind" not in result)):
        kind, message = classify(rc, limit_s, wall_s, out, err)
        if result is None:
            result = {"valid": False, "error": message[:2000], "error_kind": kind, "tokens_per_s": None}
        else:
            result.update(error_kind=kind, error=result.get("error") or message[:2000])
    result.update(run=name, cmd=" ".join(cmd), rc=None if rc == "skipped" else int(rc), wall_s=wall_s,
                  limit_s=limit_s)  # fmt: skip
    return result


def summary(result: dict) -> str:
    if not result["valid"]:
        return (
            f"INVALID {result.get('error_kind')}: {str(result.get('error') or result.get('problems'))[:300]}"
        )
    peaks = (f"gpu {result.get('peak_gpu_allocated_gib')}/{result.get('peak_gpu_reserved_gib')} GiB "
             f"host {result.get('peak_host_gib')} GiB")  # fmt: skip
    if "upload_gb_s" in result:
        return f"upload {result['upload_gb_s']} GB/s build {result.get('build_s')} s {peaks}"
    return f"{result.get('tokens_per_s')} tok/s mfu {result.get('mfu')} hfu {result.get('hfu')} {peaks}"


def main(argv: list[str]) -> int:
    name, rc, limit_s, wall_s, log, *cmd = argv
    result = record(name, rc, int(limit_s), int(wall_s), read(log + ".out"), read(log + ".err"), cmd)
    print(json.dumps(result), flush=True)
    print(f"[{name}] rc={rc} {wall_s}s/{limit_s}s {summary(result)}", file=sys.stderr)
    return 0 if result["valid"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
