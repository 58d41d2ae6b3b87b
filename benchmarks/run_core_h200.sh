#!/usr/bin/env bash
# Issue [5]'s closing measurements on one H200, one part per device command (each ends within DEADLINE_S,
# default 540 s, so it fits a 10-minute command with the transfers):
#   PARTS=old_new  bash benchmarks/run_core_h200.sh "$OUT"   # (a) no regression: 9c79c2e against this tree
#   PARTS=resident bash benchmarks/run_core_h200.sh "$OUT"   # (b) fsdp:d1 and plain PyTorch, uncapped GPU
#   PARTS=capped   bash benchmarks/run_core_h200.sh "$OUT"   # (c) RoundPipe sweep + laden's two modes (carry .rp)
#   PARTS=deepspeed bash benchmarks/run_core_h200.sh "$OUT"  # (d) DeepSpeed ZeRO-Offload sweep + laden's exact step (carry .ds)
# Parts combine (PARTS="old_new resident" REF_REPEATS=1 fits one command, about 480 s); without .git on the
# machine, archive the old tree first (`git archive 9c79c2e | tar -x -C .old`, an ignored folder, carried)
# and pass OLD_DIR=.old; CAPPED_LADEN=0 leaves the laden runs out of `capped` (when `resident` had them); SMOKE=1 runs the same
# plumbing on the CPU with the tiny model (RoundPipe needs a GPU: one point runs and reports no_gpu when its
# wheels are in .rp/, the others are recorded as skipped).
#
# What each part runs, every run its own process, all on the reference workload (BENCHMARKS.md: Qwen3-1.7B
# shape, 16 x 4096 tokens per optimizer step, 5 timed steps after 1 warm-up):
#   old_new  laden's roundpipe engine as RESULTS measures it (4 micro-batches, stage recompute, async step,
#            no clipping, 24 GiB cap) at OLD_COMMIT (default 9c79c2e, the parent of 0ad982b) and in this
#            tree, REF_REPEATS pairs (default 3), alternating old/new then new/old so a drift of the machine
#            cancels. The old tree is `git archive OLD_COMMIT` in /tmp (its own scripts and module paths;
#            an archive rather than `git worktree add`, which would write into this checkout's .git); each
#            side imports laden from its own tree (checked before the runs).
#   resident fsdp:d1 (train_throughput --system fsdp: FSDPEngine from laden's engine factory, the runtime's
#            patches; the exact synchronous step with clipping, the only one it has) with gradient
#            checkpointing off and on (profiled after the timed steps: what bounds it); laden's roundpipe
#            engine in both modes (capped) for the ratios; plain PyTorch (--system plain: stock Hugging
#            Face, fused AdamW, clipping 1.0 as Hugging Face's Trainer does) off and on, last (the shortest
#            runs). fsdp and plain uncapped. A checkpointing-off run that runs out of GPU memory is recorded
#            and retried with 8 micro-batches of 2 sequences (the same tokens).
#   capped   laden's roundpipe engine, the exact synchronous step with clipping (the `laden sft` default)
#            and the one-step-stale step without clipping, then RoundPipe 0.1.1 (PyPI, transformers 4.57.1 in
#            its own process, async step, no clipping: it has no other) over RP_POINTS, "num_microbatch:
#            limit" (default 4:22gib 4:14.4 8:22gib 2:22gib 8:14.4 2:14.4): 22gib is laden's budget, the cap
#            less 2 GiB, in the same bytes (roundpipe_ref --model-memory-limit-gib: RoundPipe counts layer
#            bytes in GB), 14.4 RoundPipe's own default on the 24 GiB card (0.6 x 24, its number as is).
#            Everything under the 24 GiB cap, with the same allocator setting.
# Every process of every part runs with PYTORCH_CUDA_ALLOC_CONF=$ALLOC_CONF (default expandable_segments:True;
# ALLOC_CONF= runs all with the default allocator): laden and RoundPipe get the same one.
#
# Writes to OUT: <part>.jsonl (one JSON line per run: the script's result plus run, cmd, rc, wall_s, limit_s;
# a run that printed no result gets an error line with error_kind: gpu_oom, host_oom, timeout, skipped,
# error), summary.json (benchmarks/core_summary.py: per part, each system's best and every sweep point, the
# ratios within the part: new/old, fsdp/roundpipe engine, laden/RoundPipe, laden/plain), runs.log (the last
# lines of every run's output).
#
# Time (nominal limits; measured figures from RESULTS.md: laden reference run 65 to 72 s, RoundPipe 46 to
# 57 s, plain 30 s, RoundPipe's Adam kernel build + install 44 s):
#   old_new  6 x ~65 s (REF_REPEATS=3)                                             ~ 400 s
#   resident fsdp 2 x ~70, plain 2 x ~40, laden 2 x ~65, OOM retries 0 to 2 x ~60      ~ 350 to 470 s
#   capped   install + kernel ~45, laden 2 x ~65, RoundPipe 6 x ~50                   ~ 480 s
# Each run's timeout is cut to what is left before DEADLINE_S; a run left with under 30 s is skipped and
# recorded as skipped (most important runs first), so a slow machine loses the last sweep points, not the
# result file.
set -uo pipefail
out=${1:?usage: PARTS="old_new|resident|capped|deepspeed ..." bash benchmarks/run_core_h200.sh OUTDIR}
parts=" ${PARTS:?set PARTS to one or more of: old_new resident capped} "
for part in $parts; do
  [[ " old_new resident capped deepspeed " == *" $part "* ]] || { echo "unknown part $part (old_new resident capped deepspeed)" >&2; exit 2; }
done
want() { [[ $parts == *" $1 "* ]]; }
mkdir -p "$out"
: >"$out/runs.log"
logs=/tmp/core_bench_logs
mkdir -p "$logs"
deadline_s=${DEADLINE_S:-540}
min_run_s=30
smoke=${SMOKE:-0}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [[ -n ${ALLOC_CONF-expandable_segments:True} ]]; then
  export PYTORCH_CUDA_ALLOC_CONF=${ALLOC_CONF-expandable_segments:True}
else
  unset PYTORCH_CUDA_ALLOC_CONF
fi
source benchmarks/bench_lib.sh

model=qwen3-1.7b seq=4096 steps=(--steps 5 --warmup 1)
if [[ $smoke == 1 ]]; then
  model=tiny seq=32 steps=(--steps 2 --warmup 1)
fi
ref=(--model "$model" --seq-len "$seq" --num-seqs 16 --num-microbatch 4 "${steps[@]}")
tt=(python3 benchmarks/train_throughput.py)
laden_async=("${tt[@]}" --system laden --recompute-grain stage --optim-step async --clip 0)
laden_sync=("${tt[@]}" --system laden --recompute-grain stage --optim-step sync --clip 1)
fsdp=("${tt[@]}" --system fsdp --clip 1)
plain=("${tt[@]}" --system plain --clip 1)
rp_env=(env PYTHONPATH=/tmp/rpsite TORCH_EXTENSIONS_DIR=/tmp/rp_torch_ext)
rp=("${rp_env[@]}" python3 benchmarks/roundpipe_ref.py --recompute-grain stage --optim-step async)
echo "== run_core_h200 PARTS=$parts DEADLINE_S=$deadline_s SMOKE=$smoke PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF-<unset>}" >&2

# run_or_retry NAME NOMINAL_S CMD...: run; if it ran out of GPU memory, once more as NAME_mb8 with 8 micro-batches.
run_or_retry() {
  local name=$1 limit=$2
  shift 2
  run "$name" "$limit" "$@"
  if [[ $(last_error_kind) == gpu_oom && $smoke != 1 ]]; then
    run "${name}_mb8" "$limit" "$@" --num-microbatch 8
  fi
}

# (a) old against new, the reference roundpipe workload.
if want old_new; then
  results=$out/old_new.jsonl
  : >"$results"
  if [[ -n ${OLD_DIR:-} ]]; then  # the old tree, archived on a machine with the repository (no .git here)
    old_commit=${OLD_COMMIT:-9c79c2e}
    old_dir=$(cd "$OLD_DIR" && pwd)
  else
    old_commit=$(git rev-parse --verify "${OLD_COMMIT:-9c79c2e}^{commit}") || exit 3
    old_dir=/tmp/laden_old_${old_commit:0:12}
    rm -rf "$old_dir" && mkdir -p "$old_dir"
    git archive "$old_commit" | tar -x -C "$old_dir" || { echo "!! git archive $old_commit failed" >&2; exit 3; }
  fi
  old_laden=$(env -C "$old_dir" PYTHONPATH="$old_dir" python3 -c 'import laden; print(laden.__file__)')
  new_laden=$(python3 -c 'import laden; print(laden.__file__)')
  echo "== old tree $old_dir ($old_commit): laden from $old_laden; new: laden from $new_laden" | tee -a "$out/runs.log" >&2
  if [[ $old_laden != "$old_dir"/* || $new_laden != "$PWD"/* ]]; then
    echo "!! laden does not resolve to each side's own tree; not measuring" >&2
    exit 3
  fi
  old=(env -C "$old_dir" PYTHONPATH="$old_dir" GIT_COMMIT="$old_commit" "${laden_async[@]}")
  for i in $(seq 1 "${REF_REPEATS:-3}"); do
    if ((i % 2)); then
      run "old_ref_$i" 130 "${old[@]}" "${ref[@]}"
      run "new_ref_$i" 130 "${laden_async[@]}" "${ref[@]}"
    else
      run "new_ref_$i" 130 "${laden_async[@]}" "${ref[@]}"
      run "old_ref_$i" 130 "${old[@]}" "${ref[@]}"
    fi
  done
fi

# (b) the resident engines on the uncapped GPU, and laden's roundpipe engine (capped) in the same command.
if want resident; then
  results=$out/resident.jsonl
  : >"$results"
  # fsdp and the roundpipe engine first (the fsdp:d1 target), plain PyTorch (the shortest runs) last.
  run_or_retry fsdp_gc_off 150 "${fsdp[@]}" "${ref[@]}" --no-gradient-checkpointing --profile
  run fsdp_gc_on 150 "${fsdp[@]}" "${ref[@]}" --gradient-checkpointing --profile
  run laden_sync 130 "${laden_sync[@]}" "${ref[@]}"
  run laden_async 130 "${laden_async[@]}" "${ref[@]}"
  run_or_retry plain_gc_off 100 "${plain[@]}" "${ref[@]}" --no-gradient-checkpointing
  run plain_gc_on 100 "${plain[@]}" "${ref[@]}" --gradient-checkpointing
fi

# (c) under the 24 GiB cap: laden's two modes, then RoundPipe's sweep.
if want capped; then
  results=$out/capped.jsonl
  : >"$results"
  # The wheels into their own directory, then RoundPipe's host Adam kernel, built alone (not during a run).
  rp_ready=1
  timeout 40 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/rpsite .rp/*.whl >>"$out/runs.log" 2>&1 || { rp_ready=0; echo "!! RoundPipe wheels did not install (.rp/ carried?)" >&2; }
  if [[ $smoke != 1 && $rp_ready == 1 ]]; then
    timeout -k 5 150 "${rp_env[@]}" python3 -c 'from roundpipe.optim.optim_builder import load_optim_function as f; f("adam")' \
      >>"$out/runs.log" 2>&1 || echo "!! RoundPipe's Adam kernel did not build" >&2
  fi
  if [[ ${CAPPED_LADEN:-1} == 1 ]]; then  # CAPPED_LADEN=0: the laden runs came with another part's command
    run laden_sync 130 "${laden_sync[@]}" "${ref[@]}"
    run laden_async 130 "${laden_async[@]}" "${ref[@]}"
  fi
  first=1
  for p in ${RP_POINTS:-4:22gib 4:14.4 8:22gib 2:22gib 8:14.4 2:14.4}; do
    nmb=${p%%:*} limit=${p#*:} budget=(--model-memory-limit "${p#*:}")
    [[ $limit == *gib ]] && budget=(--model-memory-limit-gib "${limit%gib}")
    if [[ $smoke == 1 && ($first == 0 || $rp_ready == 0) ]]; then  # on the CPU: one point checks the plumbing
      SKIP_REASON="SMOKE=1: RoundPipe needs a GPU (one point checks the plumbing)" \
        record "rp_mb${nmb}_lim${limit}" skipped 0 0 "$logs/none" "${rp[@]}" "${ref[@]}"
      continue
    fi
    first=0
    run "rp_mb${nmb}_lim${limit}" 120 "${rp[@]}" "${ref[@]}" --num-microbatch "$nmb" "${budget[@]}"
  done
fi

# (d) DeepSpeed ZeRO-Offload under the same 24 GiB cap (benchmarks/deepspeed_offload.py), beside laden's exact
# synchronous step (DS_LADEN=0 leaves it out when another part's command had it): its CPU Adam built first,
# alone (DeepSpeed's op builder, nvcc and ninja), then DS_POINTS, "stage:micro-batch:checkpointing" (default:
# stage 3 (parameters and optimizer offloaded) and stage 2 (optimizer offloaded) at micro-batches 1, 2, 4
# with checkpointing, then 1 without). Wheels in .ds/: deepspeed (a pure-Python wheel: DS_BUILD_OPS=0 pip
# wheel --no-deps deepspeed), hjson, pydantic, pydantic-core, annotated-types, typing-inspection.
if want deepspeed; then
  results=$out/deepspeed.jsonl
  : >"$results"
  ds_env=(env PYTHONPATH=$PWD:/tmp/dssite TORCH_EXTENSIONS_DIR=/tmp/ds_torch_ext)
  timeout 60 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/dssite .ds/*.whl >>"$out/runs.log" 2>&1 || echo "!! DeepSpeed wheels did not install (.ds/ carried?)" >&2
  if [[ $smoke != 1 ]]; then
    timeout -k 5 240 "${ds_env[@]}" python3 -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()' \
      >>"$out/runs.log" 2>&1 || echo "!! DeepSpeed's CPU Adam did not build (runs.log has the error)" >&2
  fi
  [[ ${DS_LADEN:-1} == 1 ]] && run laden_sync 130 "${laden_sync[@]}" "${ref[@]}"
  for p in ${DS_POINTS:-3:1:on 3:2:on 3:4:on 2:1:on 2:2:on 2:4:on 3:1:off 2:1:off}; do
    IFS=: read -r stage mb gc <<<"$p"
    gcflag=--gradient-checkpointing
    [[ $gc == off ]] && gcflag=--no-gradient-checkpointing
    run "ds_z${stage}_mb${mb}_gc${gc}" 150 "${ds_env[@]}" python3 benchmarks/deepspeed_offload.py --model "$model" \
      --seq-len "$seq" --num-seqs 16 "${steps[@]}" --stage "$stage" --micro-batch "$mb" $gcflag
  done
fi

echo "== done in ${SECONDS}s" >&2
files=()
for part in old_new resident capped deepspeed; do
  want "$part" && files+=("$out/$part.jsonl")
done
python3 benchmarks/core_summary.py "${files[@]}" >"$out/summary.json"
