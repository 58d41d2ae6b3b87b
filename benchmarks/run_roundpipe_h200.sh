#!/usr/bin/env bash
# laden's roundpipe engine vs RoundPipe 0.1.1 (PyPI) vs plain PyTorch on one H200, in ONE device command
# (plain: stock Hugging Face, `train_throughput.py --system plain`; laden's former LocalEngine before issue 5;
# the fair comparison of issue 5, same allocator and planner budget for both, is run_core_h200.sh)
# (the run carries .rp/, the RoundPipe wheels; see benchmarks/roundpipe_ref.py):
#   bash benchmarks/run_roundpipe_h200.sh "$OUT"
# Writes to OUTDIR: results.jsonl (one JSON line per run: train_throughput's keys plus run, cmd, rc,
# wall_s, limit_s; a run that printed no result gets an error line with error_kind: gpu_oom, host_oom,
# timeout, skipped, error), pytest.log, runs.log (the last lines of every run's output).
# SMOKE=1 runs the same plumbing with the tiny model and short sequences (CPU check).
# PARTS picks what runs (default: all of "tests ref compile 8b seq pin", in that order): tests =
# laden's roundpipe GPU tests, ref = the reference workload (laden, RoundPipe, plain), ref8 / ref16 = laden
# on it with 8 / 16 micro-batches, fused = 16 with --fused-elementwise (laden's default on a GPU), eager8 =
# ref8 with --no-fused-elementwise, limit23 = ref8 with a 23 GiB model_memory_limit, gc = 16 and 8
# micro-batches with --gc-freeze, spy = ref under py-spy, switch = ref8 with a 0.5 ms GIL switch
# interval, chunk2k = ref with 2048-token loss chunks, again = laden and RoundPipe on the reference
# workload a second time, after ref (run-to-run spread), joint = laden on it with --no-static-last-dims
# (the fused kernels' former dynamic last dims), then with --joint-projections (these eleven not in the
# default),
# compile = laden on it with compiled layers, 8b = Qwen3-8B shape, seq = the longest-sequence runs, pin =
# host peak and upload bandwidth per pin_model mode.
#
# Time budget. The device command may run 600 s; this script ends within about 545 s whatever happens:
# every run has its own `timeout` (SIGTERM, SIGKILL 10 s later), cut to what is left before a deadline
# DEADLINE_S=530 s after the start, and a run left with under 30 s is skipped. Nominal limits, in
# order (most important first, so a slow machine loses the least important runs):
#   install 40, pytest 200, laden ref 100, RoundPipe ref 130, plain ref 80, laden compiled 300,
#   laden 8B 170, laden 262144 180, RoundPipe 131072 100, RoundPipe 65536 80, pin 3 x 60
#   = 1450 s in all, so the deadline, not the sum, is the bound: run it in parts with PARTS, e.g.
#   PARTS="ref compile" (about 520 s) and PARTS="tests 8b pin" (about 300 s). RoundPipe's host Adam
#   kernel compiles during pytest (or alone), at most 150 s from the start, and is waited for before
#   the measured runs.
# Measured on an H200 (2026-11-30, first run of this script): install + pytest + compile 45, laden ref
# 72, RoundPipe ref 57; the Qwen3 shapes are now initialised on the GPU (a CPU random fill runs on one
# core: it cost the 8B run its 150 s). laden at 131072 tokens trained there (34 s/step, 14.2 GiB), so
# the sweep now starts at 262144; RoundPipe's 131072 point (out of GPU memory per BENCHMARKS.md) comes
# before its 65536 one. Second round (same day, new planner): install + RoundPipe's kernel 44, laden ref
# (8 micro-batches, --profile) 70, RoundPipe ref 46, plain 30, laden ref16 44, laden 8B 60, GPU tests 42,
# pin_model 24 to 36 per mode; PARTS="ref ref16" took 233 s and PARTS="tests 8b pin" 196 s.
set -uo pipefail
out=${1:?usage: bash benchmarks/run_roundpipe_h200.sh OUTDIR}
mkdir -p "$out"
results=$out/results.jsonl
: >"$results"  # this run's results only
parts=" ${PARTS:-tests ref compile 8b seq pin} "
want() { [[ $parts == *" $1 "* ]]; }
logs=/tmp/rp_bench_logs
mkdir -p "$logs"
deadline_s=${DEADLINE_S:-530}
min_run_s=30
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

# Shapes: the reference workload (Qwen3-1.7B, 16 x 4096 tokens per step) and the capacity sweeps.
m17=qwen3-1.7b m8=qwen3-8b ref_seq=4096 laden_seq=262144 rp_seqs=(131072 65536)
if [[ ${SMOKE:-0} == 1 ]]; then
  m17=tiny m8=tiny ref_seq=32 laden_seq=128 rp_seqs=(128 64)
fi
# No system clips gradients (RoundPipe's step cannot); both offloaded engines take one-step-stale async steps.
laden=(python3 benchmarks/train_throughput.py --system laden --clip 0 --optim-step async)
plain=(python3 benchmarks/train_throughput.py --system plain --clip 0)
# RoundPipe: its own interpreter path (transformers 4.57.1), the default CUDA allocator unless RP_ALLOC_CONF.
rp_env=(env -u PYTORCH_CUDA_ALLOC_CONF ${RP_ALLOC_CONF:+PYTORCH_CUDA_ALLOC_CONF=$RP_ALLOC_CONF}
  PYTHONPATH=/tmp/rpsite TORCH_EXTENSIONS_DIR=/tmp/rp_torch_ext)
rp=("${rp_env[@]}" python3 benchmarks/roundpipe_ref.py --optim-step async)
# Five timed steps: with three, identical runs differed by up to a third (RESULTS, third round).
ref=(--model "$m17" --seq-len "$ref_seq" --num-seqs 16 --num-microbatch 4 --recompute-grain stage --steps 5 --warmup 1)
sweep=(--model "$m17" --num-seqs 1 --num-microbatch 1 --recompute-grain layer --steps 1 --warmup 1)

# record and run (benchmarks/bench_lib.sh): one run under its own timeout cut to the deadline, one JSON line.
source benchmarks/bench_lib.sh

# (a) RoundPipe's wheels into their own directory; its Adam kernel compiles while the GPU tests run.
timeout 40 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/rpsite .rp/*.whl >"$out/runs.log" 2>&1 || echo "!! RoundPipe wheels did not install" >&2
precompile_pid=
if [[ ${SMOKE:-0} != 1 ]] && { want ref || want seq; }; then
  timeout -k 5 150 "${rp_env[@]}" python3 -c 'from roundpipe.optim.optim_builder import load_optim_function as f; f("adam")' \
    >"$logs/precompile.log" 2>&1 &
  precompile_pid=$!
fi

# (b) laden's roundpipe and attention GPU tests.
want tests || echo "skipped (PARTS=$parts)" >"$out/pytest.log"
want tests && {
left=$((deadline_s - SECONDS))
# The whole of test_grad_sink and test_sink_linear (their engine tests run on the GPU when there is
# one), then the GPU-marked tests of the others (the one-GPU kind).
pytest_s=${PYTEST_S:-200}
timeout -k 5 $((left < pytest_s ? left : pytest_s)) bash -c 'python3 -m pytest -q -x -p no:cacheprovider -m "not multigpu" \
  tests/model/test_grad_sink.py tests/model/test_sink_linear.py && python3 -m pytest -q -x -p no:cacheprovider \
  -m "gpu and not multigpu" tests/engine/roundpipe/test_roundpipe_gpu.py tests/model/test_attention.py tests/model/test_fused_rotary.py \
  tests/model/test_loss.py' \
  >"$out/pytest.log" 2>&1
rc=$?
python3 -c 'import json, sys; print(json.dumps({"run": "pytest_roundpipe_gpu", "rc": int(sys.argv[1]),
  "valid": sys.argv[1] == "0", "summary": sys.argv[2]}))' "$rc" "$(tail -n 1 "$out/pytest.log")" >>"$results"
echo "[pytest] rc=$rc $(tail -n 1 "$out/pytest.log")" >&2
}

# (c) the reference workload, one system after the other, with nothing else running (the compile
# would take host cores from the measured runs' host optimizers).
if [[ -n $precompile_pid ]]; then
  wait "$precompile_pid"
  { echo "== precompile rc=$?"; tail -n 20 "$logs/precompile.log"; } >>"$out/runs.log"
fi
# laden runs its defaults (on a GPU: fused elementwise math, actor.fused_elementwise) with RoundPipe's
# 4 micro-batches of 4 sequences: its planner keeps 12 of the 30 pipeline layers in the fused stage (no
# recompute) and recomputes the rest. 8 micro-batches of 2 sequences (ref8) keep 19 layers but launch
# twice the kernels, each half as long, and the Python thread feeding them then shows (see RESULTS).
if want ref; then
  run laden_ref 130 "${laden[@]}" "${ref[@]}" --profile
  run roundpipe_ref 130 "${rp[@]}" "${ref[@]}"
  run plain_ref 80 "${plain[@]}" "${ref[@]}"
fi
# A second pair of the two measured systems, unprofiled: how far apart two runs of the same command are.
if want again; then
  run laden_ref_again 130 "${laden[@]}" "${ref[@]}"
  run roundpipe_ref_again 130 "${rp[@]}" "${ref[@]}"
fi
# The fused kernels with dynamic last dims (the default until the seventh round of RESULTS.md), and joint
# projections (one GEMM for q/k/v and for gate/up; off by default, slower in the seventh round).
if want joint; then
  run laden_ref_dynamic 130 "${laden[@]}" "${ref[@]}" --no-static-last-dims --profile
  run laden_ref_joint 130 "${laden[@]}" "${ref[@]}" --joint-projections --profile
fi
# Twice the loss chunk: half the passes over the head's fp32 gradient accumulator, 0.6 GiB more transient.
want chunk2k && run laden_ref_chunk2k 130 "${laden[@]}" "${ref[@]}" --loss-chunk-size 2048
# The same with 8 micro-batches of 2 sequences (the reference setting of the third round).
want ref8 && run laden_ref_mb8 130 "${laden[@]}" "${ref[@]}" --num-microbatch 8 --profile
want ref16 && run laden_ref_mb16 100 "${laden[@]}" "${ref[@]}" --num-microbatch 16
# actor.fused_elementwise: the lean modules' elementwise math compiled (the warm-up step compiles it).
want fused && run laden_ref_fused 150 "${laden[@]}" "${ref[@]}" --num-microbatch 16 --fused-elementwise --profile
# laden's default runs its elementwise math fused on a GPU; eager8 is ref8 without it (the default
# before 2026-11-30's third round).
want eager8 && run laden_ref_eager_mb8 150 "${laden[@]}" "${ref[@]}" --num-microbatch 8 --no-fused-elementwise --profile
# ref8 with 1 GiB less headroom under the cap (model_memory_limit 23 instead of 22 GiB): the planner
# keeps more layers out of recompute; peak reserved memory and allocator retries say whether it is safe.
want limit23 && run laden_ref_limit23 150 "${laden[@]}" "${ref[@]}" --num-microbatch 8 --model-memory-limit 23
# The same two with the cyclic garbage collector stopped for the timed steps (are its pauses a bound?).
want gc && run laden_ref_fused_gc 150 "${laden[@]}" "${ref[@]}" --num-microbatch 16 --fused-elementwise --gc-freeze
want gc && run laden_ref_fused_mb8_gc 150 "${laden[@]}" "${ref[@]}" --num-microbatch 8 --fused-elementwise --gc-freeze
# Where the host threads spend a step that waits for them: ref under py-spy, Python frames. Needs the py-spy wheel in
# the carried, ignored .prof/ (pip download py-spy); writes spy.txt (collapsed stacks, one per thread).
if want spy; then
  if python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .prof/py_spy-*.whl >>"$out/runs.log" 2>&1; then
    # Without pausing the process (--nonblocking: it runs at full speed), Python frames only: every
    # thread's samples (--idle), then only the samples of the thread holding the GIL (--gil).
    run laden_ref_spy 150 /tmp/pyspy/bin/py-spy record --nonblocking --threads --idle -r 200 -f raw \
      -o "$out/spy.txt" -- "${laden[@]}" "${ref[@]}"
    run laden_ref_spy_gil 150 /tmp/pyspy/bin/py-spy record --nonblocking --threads --gil -r 200 -f raw \
      -o "$out/spy_gil.txt" -- "${laden[@]}" "${ref[@]}"
  else
    echo "!! no py-spy wheel in .prof/: spy skipped" >&2
  fi
fi
# ref8 with a 0.5 ms switch interval: does a thread running Python hold the GIL from the feeding thread?
want switch && run laden_ref_switch 150 "${laden[@]}" "${ref[@]}" --num-microbatch 8 --switch-interval 0.0005 --profile
# actor.roundpipe.compile: the warm-up step pays for the compilation.
want compile && run laden_ref_compile 300 "${laden[@]}" "${ref[@]}" --num-microbatch 8 --compile --profile

# (d) Qwen3-8B shape: laden with the bf16 Kahan AdamW (8 bytes of state per parameter), 4 x 4096 tokens.
# sync step: the one-step-stale async step needs a second weight buffer and gradient inbox (14 vs 10 B/param).
want 8b && run laden_8b 170 "${laden[@]}" --model "$m8" --optimizer adam_bf16 --optimizer-dtype bfloat16 --optim-step sync --seq-len "$ref_seq" \
  --num-seqs 4 --num-microbatch 4 --recompute-grain stage --steps 2 --warmup 1

# (e) longest sequence, one per step, layer recompute, no warm-up step (the first step is the timed one).
# laden tiles each MLP over 16k-token pieces and keeps no fp32 RMSNorm copies (actor.tiled_mlp_tokens).
want seq && run "laden_seq${laden_seq}" 180 "${laden[@]}" "${sweep[@]}" --tiled-mlp-tokens 16384 --seq-len "$laden_seq" --warmup 0
# RoundPipe: its failing point first (as BENCHMARKS.md has it), then the one below it.
for seq in "${rp_seqs[@]}"; do
  want seq && run "roundpipe_seq$seq" 100 "${rp[@]}" "${sweep[@]}" --seq-len "$seq"
done

# (f) pin_model: build time, host peak and weight-upload bandwidth per mode (one process each).
for mode in alloc register off; do
  want pin && run "pin_$mode" 60 python3 benchmarks/pin_model.py --model "$m17" --pin-model "$mode"
done

echo "== done in ${SECONDS}s; results in $results" >&2
python3 - "$results" <<'PY' >&2
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    speed = f"upload {r['upload_gb_s']} GB/s" if "upload_gb_s" in r else f"{r.get('tokens_per_s')} tok/s hfu {r.get('hfu')}"
    what = (f"{speed} gpu {r.get('peak_gpu_allocated_gib')} GiB "
            f"host {r.get('peak_host_gib')} GiB" if r.get("valid") else f"INVALID {r.get('error_kind')}")
    print(f"{r.get('run')}: {what}" if "summary" not in r else f"{r['run']}: {r['summary']}")
PY
