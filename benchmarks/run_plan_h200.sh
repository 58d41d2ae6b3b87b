#!/usr/bin/env bash
# Issue [9]'s measurements on one H200, a part per name in PARTS (each under its own timeout):
#   tests     the GPU tests not run before: roundpipe router capture and ModelTimer, the RL GPU tests
#   train     benchmarks/plan_accuracy.py: the training configurations (both engines)
#   gen       benchmarks/plan_accuracy.py: the generation configurations (native beside fsdp)
#   auto      benchmarks/auto_sweep.py: auto knobs against a hand-tuned sweep under a 24 GiB cap
# Writes OUT/<part>.jsonl (JSON lines) and OUT/<part>.log; plans, profiles and logs under OUT/work.
#   PARTS="tests train" bash benchmarks/run_plan_h200.sh "$OUT"
set -uo pipefail
out=${1:?usage: PARTS="tests train gen" bash benchmarks/run_plan_h200.sh OUTDIR}
parts=" ${PARTS:-train} "
mkdir -p "$out"
source benchmarks/parts_lib.sh
work=${WORK:-/tmp/plan_acc}
want tests && run tests "${TESTS_S:-150}" python -m pytest -q -m gpu -p no:cacheprovider \
  tests/engine/roundpipe/test_roundpipe_gpu.py tests/rl/test_rl_gpu.py
want train && run train "${TRAIN_S:-420}" python benchmarks/plan_accuracy.py --work "$work" --parallel "${PAR:-3}" \
  --only ${TRAIN_ONLY:-fsdp-0.6b-2k fsdp-0.6b-8k-gc fsdp-0.6b-4k-full-logits fsdp-1.7b-2k fsdp-1.7b-16k-gc fsdp-1.7b-32k-gc roundpipe-0.6b-2k roundpipe-0.6b-8k-layer roundpipe-0.6b-4k-full-logits roundpipe-1.7b-4k-limit8 roundpipe-1.7b-16k-layer roundpipe-1.7b-32k fsdp-0.6b-16k-gc-full-logits fsdp-1.7b-4k roundpipe-0.6b-16k-limit8 roundpipe-1.7b-8k-layer-full-logits}
want gen && run gen "${GEN_S:-300}" python benchmarks/plan_accuracy.py --work "$work" \
  --only ${GEN_ONLY:-native-0.6b-b64-1k native-0.6b-b256-1k native-0.6b-b128-4k-frac0.5 native-1.7b-b64-2k}
want auto && run auto "${AUTO_S:-420}" python benchmarks/auto_sweep.py --work /tmp/auto_sweep
mkdir -p "$out/work" && cp "$work"/*.json "$work"/*.log "$out/work/" 2>/dev/null
true
