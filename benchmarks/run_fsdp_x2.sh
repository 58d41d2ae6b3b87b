#!/usr/bin/env bash
# Issue-2 measurements on two GPUs of one host, in one command. Writes JSON lines to $1 (default: stdout).
#   bash benchmarks/run_fsdp_x2.sh results.jsonl
set -uo pipefail
out=${1:-/dev/stdout}
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# Qwen3-1.7B shape, 8 x 4096 tokens per step, gradient checkpointing + chunked loss.
for backend in fsdp:d2 fsdp:d1c2 fsdp:d1t2; do
  timeout 240 python3 benchmarks/sft_cli.py --model qwen3-1.7b --seq-len 4096 --batch-size 8 --steps 5 \
    --warmup 2 --variants 11 --backend "$backend" --nproc 2 | tee -a "$out"
done
# Per-layer streamed optimizer step vs host Adam with offload_params (28 layers of the 1.7B shape).
timeout 200 torchrun --nproc_per_node 2 benchmarks/fsdp_optim_step.py --layers 28 --steps 3 | tee -a "$out"
# memory_efficient_load: host and GPU peaks per rank, without and with.
for flag in "" --memory-efficient-load; do
  timeout 150 torchrun --nproc_per_node 2 benchmarks/fsdp_memory_load.py --layers 28 $flag | tee -a "$out"
done
