# Shared by the device drivers that run named parts (run_rollout_h200.sh, run_rl_h200.sh, run_plan_h200.sh); source it,
# do not run it. The sourcing script sets: out (its output folder) and parts (" name name ... ").

# Sourcing sets the drivers' environment: this checkout first on the import path (ahead of any wheel
# directory the driver put there), and the allocator setting (ALLOC_CONF, default expandable segments).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTORCH_CUDA_ALLOC_CONF=${ALLOC_CONF-expandable_segments:True}

# wheels: the wheels in .whl (pure-Python packages the device image lacks) installed under /tmp/site
# and put on the import path after this checkout (OUT/pip.log); nothing when .whl holds none.
wheels() {
  ls .whl/*.whl >/dev/null 2>&1 || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$out/pip.log" 2>&1 || echo "!! wheel install failed (see pip.log)" >&2
  export PYTHONPATH=$PYTHONPATH:/tmp/site
}

# want NAME: whether PARTS names it.
want() { [[ $parts == *" $1 "* ]]; }

# run NAME TIMEOUT_S CMD...: CMD under its own timeout, its stdout appended to OUT/NAME.jsonl and its
# stderr to OUT/NAME.log; the status, the seconds, the newest JSON lines and the log's tail on stderr.
run() {
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "[$name] $*" >&2
  timeout "$limit" "$@" >>"$out/$name.jsonl" 2>>"$out/$name.log"
  rc=$?
  echo "[$name] rc=$rc ($((SECONDS - t0)) s)" >&2
  grep -h '^{' "$out/$name.jsonl" | tail -n 8 | cut -c1-900 >&2
  tail -n 5 "$out/$name.log" | cut -c1-400 >&2
}

# gpu_tests TIMEOUT_S: the GPU tests of the native engine and the weight updates (part `tests`).
gpu_tests() {
  run tests "$1" python -m pytest -q -m gpu -x -p no:cacheprovider \
    tests/rollout/test_native_gpu.py tests/rollout/test_triton_linear.py tests/rollout/test_triton_qkv.py tests/rollout/test_triton_sampler.py tests/rollout/test_triton_swiglu.py \
    tests/weights/test_weights_disk.py tests/weights/test_weights_xccl.py tests/weights/test_weights_inplace.py tests/rl/test_rl_gpu.py
  tail -n 6 "$out/tests.jsonl" >&2
}
