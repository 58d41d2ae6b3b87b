# Shared by the device drivers (run_roundpipe_h200.sh, run_core_h200.sh); source it, do not run it.
# The sourcing script sets: results (the JSON-lines file runs append to), out (its output folder,
# runs.log goes there), logs (a scratch folder for each run's output), deadline_s (seconds after the
# script's start by which every run has ended) and min_run_s (a run left with less is skipped).

# record NAME RC LIMIT_S WALL_S LOG CMD...: append one JSON line to $results (the run's own result, or an
# error line built from its output; benchmarks/bench_record.py); status 0 iff the result is valid.
record() {
  python3 benchmarks/bench_record.py "$@" >>"$results"
}

# run NAME NOMINAL_S CMD...: one run under its own timeout (SIGTERM, SIGKILL 10 s later), cut to the time
# left before the deadline; skipped (and recorded so) when under min_run_s is left.
run() {
  local name=$1 limit=$2 log=$logs/$1 t0 rc
  shift 2
  local left=$((deadline_s - SECONDS))
  ((limit > left)) && limit=$left
  : >"$log.out"
  : >"$log.err"
  if ((limit < min_run_s)); then
    record "$name" skipped "$((limit < 0 ? 0 : limit))" 0 "$log" "$@"
    return
  fi
  echo "== $name (t=${SECONDS}s, limit ${limit}s): $*" >&2
  t0=$SECONDS
  timeout -k 10 "$limit" "$@" >"$log.out" 2>"$log.err"
  rc=$?
  { echo "== $name rc=$rc $((SECONDS - t0))s: $*"; tail -n 30 "$log.err"; tail -n 5 "$log.out"; } >>"$out/runs.log"
  record "$name" "$rc" "$limit" "$((SECONDS - t0))" "$log" "$@"
}

# last_error_kind: the error_kind of the last line of $results (empty when it is valid).
last_error_kind() {
  tail -n 1 "$results" | python3 -c 'import json, sys; r = json.loads(sys.stdin.read() or "{}"); print(r.get("error_kind") or "")'
}
