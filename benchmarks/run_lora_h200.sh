#!/usr/bin/env bash
# Issue [8]'s H200 figure: LoRA on the roundpipe engine, the largest Qwen3-32B-layered bf16 checkpoint
# the disk holds (up to MODEL_GIB, default 40), pin_model off (memory-mapped base weights) against
# register (read into memory, page-locked), one process per mode; OUT/lora.jsonl, OUT/lora.log.
#   bash benchmarks/run_lora_h200.sh "$OUT"
set -uo pipefail
out=${1:?usage: bash benchmarks/run_lora_h200.sh OUTDIR}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
dir=${LORA_DIR:-/tmp/lora_big}
free=$(df -BG --output=avail "$(dirname "$dir")" | tail -1 | tr -dc 0-9)
gib=${MODEL_GIB:-40}
((free - 8 < gib)) && gib=$((free - 8))
echo "disk: ${free} GiB free, checkpoint ${gib} GiB" >&2
for mode in ${MODES:-off register}; do
  timeout "${LORA_S:-260}" python benchmarks/lora_mmap.py --shape qwen3-32b --dtype bf16 --model-gib "$gib" --no-cap \
    --pin-model "$mode" --rows "${ROWS:-4}" --seq-len "${SEQ:-1024}" --stage-gib "${STAGE_GIB:-8}" \
    --steps "${STEPS:-3}" --dir "$dir" >>"$out/lora.jsonl" 2>>"$out/lora.log"
  echo "[$mode] rc=$?" >&2
  tail -n 1 "$out/lora.jsonl" >&2
  tail -n 3 "$out/lora.log" | cut -c1-400 >&2
done
exit 0
