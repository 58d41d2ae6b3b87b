#!/usr/bin/env bash
# Issue [6]'s measurements on one H200, a part per name in PARTS (each run under its own timeout):
#   tests    the GPU tests of the native engine and the weight updates (pytest -m gpu)
#   A        workload A: native vs transformers generate (static) vs generate_batch, batch 256 and 64
#   B        workload B: 256 requests, prompt and output lengths uniform in [100, 1024], native
#   greedy   SmolLM2-135M-Instruct (real weights, in SMOL_DIR): native greedy text == transformers'
#   weights  weight updates: disk and xccl at 256/512/1024 MB buckets (0.6B, 1.7B), in place (1.7B, 8B)
#   kernels  the decode step's kernels alone: projections (cuBLAS vs split-K), the paged decode kernel
#   profile  workload B under the profiler (the top 40 kernels)
#   options  workload A, batch 256, native: the defaults, then each untried option (OPTIONS) alone, then
#            the winners together when time is left (OPTIONS_BUDGET_S); the pick (benchmarks/pick_options.py,
#            the fastest run when 1% above the defaults) goes to OUT/options.picked and .bench/picked_options,
#            which the device keeps between calls (ignored by git) for A_OPTIONS=picked
# A_OPTIONS  kernel options for native in part A: MODULE.NAME=VALUE words, or `picked` (.bench/picked_options)
#   tune     the untried kernel options, each kernel alone: the decode kernel's PREFETCH_TABLE,
#            HEADS_PER_PROGRAM and MAX_REGISTERS, the sampler's chunk and warps, the SwiGLU kernel against the compiled
#            torch one, the split-K linear against cuBLAS above its 128 rows (triton_linear.MAX_ROWS)
# Writes OUT/<part>.jsonl (the scripts' JSON lines) and OUT/<part>.log.
#   PARTS="tests A B" bash benchmarks/run_rollout_h200.sh "$OUT"
set -uo pipefail
out=${1:?usage: PARTS="tests A B greedy weights" bash benchmarks/run_rollout_h200.sh OUTDIR}
parts=" ${PARTS:-tests A B} "
mkdir -p "$out"
source benchmarks/parts_lib.sh
want tests && gpu_tests "${TESTS_S:-480}"
# batch 256 (the target's) first; the three systems take about 415 to 500 s on a fresh machine (transformers
# compiles its static-cache step for each batch size)
a_options=${A_OPTIONS:-}
if want A && [[ $a_options == picked ]]; then
  [[ -f .bench/picked_options ]] || { echo "!! A_OPTIONS=picked: no .bench/picked_options (run PARTS=options first on this machine)" >&2; exit 2; }
  a_options=$(cat .bench/picked_options)
  echo "[A] native's kernel options from the options part: ${a_options:-the defaults}" >&2
fi
want A && run A "${A_S:-560}" python benchmarks/generate_throughput.py --workload A --batch 256 64 \
  --systems ${A_SYSTEMS:-native hf_static hf_cb} ${a_options:+--kernel-option $a_options}
want B && run B "${B_S:-240}" python benchmarks/generate_throughput.py --workload B --systems native ${B_ARGS:-}
want greedy && run greedy "${GREEDY_S:-240}" python benchmarks/generate_throughput.py --greedy-check "${SMOL_DIR:?}" --prompts 20
want weights && run weights "${WEIGHTS_S:-400}" python benchmarks/weight_update.py
want kernels && run kernels "${KERNELS_S:-300}" python benchmarks/skinny_gemm.py
want kernels && run kernels "${KERNELS_S:-300}" python benchmarks/decode_kernel.py --cases A B small r16 r32 r64 tiny \
  --tiles 128 --warps 4 --stages 2 --splits none auto 4 8 16
want kernels && run kernels "${KERNELS_S:-300}" python benchmarks/sampler_kernel.py
# (with the block table prefetched, 3 stages double-buffer the key and value tiles: Triton's
# pipeliner then has no load the addresses wait on; tests/rollout/test_triton_compile.py compiles them)
want tune && run tune "${TUNE_S:-200}" python benchmarks/decode_kernel.py --cases A B r16 r64 --tiles 64 128 \
  --warps 4 --stages 2 3 --splits auto --prefetch-table on off
want tune && run tune "${TUNE_S:-200}" python benchmarks/decode_kernel.py --cases A B r16 r64 --tiles 32 64 \
  --warps 4 --stages 2 3 --splits auto --heads-per-program 2 --prefetch-table on off
# (the default takes 197 registers a thread, two programs an SM; capped, three or four)
want tune && run tune "${TUNE_S:-200}" python benchmarks/decode_kernel.py --cases A B r16 r64 --tiles 64 128 \
  --warps 4 --stages 2 --splits auto --max-registers none 168 128
want tune && run tune "${TUNE_S:-150}" python benchmarks/sampler_kernel.py --rows 64 256 --warps 4 8
want tune && run tune "${TUNE_S:-150}" python benchmarks/swiglu_kernel.py --blocks 512 1024 2048 --warps 4 8
want tune && run tune "${TUNE_S:-150}" python benchmarks/skinny_gemm.py --rows 128 192 256 --block-n 32 64 \
  --block-k 128 --splits 1 2 4
# options: workload A at batch 256 (native) with the defaults, then with each untried option alone
# (an entry's options joined by +: set together), then the winners together. A run starts only while
# the part's time so far plus its longest run fits OPTIONS_BUDGET_S, so the pick is written inside
# one device call (600 s at most).
options_t0=$SECONDS
longest=0
options_run() {  # options_run LABEL [MODULE.NAME=VALUE ...]: one run of the part, if it fits the budget
  local label=$1 t=$SECONDS
  shift
  if (( SECONDS - options_t0 + longest > ${OPTIONS_BUDGET_S:-560} )); then
    echo "[options] $label skipped: $((SECONDS - options_t0)) s used, runs take up to $longest s" >&2
    return
  fi
  run options "${OPTIONS_S:-150}" python benchmarks/generate_throughput.py --workload A --batch 256 \
    --systems native ${1:+--kernel-option "$@"}
  (( SECONDS - t > longest )) && longest=$((SECONDS - t))
}
if want options; then
  for opt in "" ${OPTIONS:-triton_swiglu.IN_DECODE=True triton_decode.HEADS_PER_PROGRAM=2 \
      triton_decode.PREFETCH_TABLE=True+triton_decode.NUM_STAGES=3 triton_decode.MAX_REGISTERS=128 \
      triton_linear.MAX_ROWS=256 triton_sampler.METHOD=cdf}; do
    options_run "${opt:-the defaults}" ${opt//+/ }
  done
  together=$(python benchmarks/pick_options.py "$out/options.jsonl" --union)
  [[ -n $together ]] && options_run "together: $together" $together
  mkdir -p .bench
  if python benchmarks/pick_options.py "$out/options.jsonl" >"$out/options.picked"; then
    cp "$out/options.picked" .bench/picked_options
  else
    rm -f .bench/picked_options
  fi
fi
want profile && run profile "${PROFILE_S:-240}" python benchmarks/generate_throughput.py --workload B --systems native --profile --profile-top 40
exit 0
