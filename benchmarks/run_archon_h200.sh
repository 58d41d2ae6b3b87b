#!/usr/bin/env bash
# The archon engine on one H200 (issue [10]): a small Qwen3-MoE shape trained by archon:d1 beside fsdp:d1
# (benchmarks/moe_train.py, one process per run, in the order fsdp, archon, fsdp, archon: the run-to-run
# spread shows beside the difference). The CPU tests cover the layouts; there are no GPU-only ones.
#   bash benchmarks/run_archon_h200.sh "$OUT"
set -u
out=${1:?usage: run_archon_h200.sh OUT_DIR}
parts=" ${PARTS:-moe} "
mkdir -p "$out"
source benchmarks/parts_lib.sh
if want moe; then
  for backend in fsdp:d1 archon:d1 fsdp:d1 archon:d1; do
    run moe 240 python benchmarks/moe_train.py --backend "$backend" --steps ${STEPS:-16} --warmup 3
  done
fi
