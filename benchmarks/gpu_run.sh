#!/usr/bin/env bash
# Runs on the GPU machine from the repository root: environment facts, then the given benchmark commands.
# Usage: bash benchmarks/gpu_run.sh "<command 1>" "<command 2>" ...   (each output also saved under $OUT)
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
  git rev-parse --short HEAD 2>/dev/null; } 2>&1 | tee "$OUT/env.txt"
i=0
for cmd in "$@"; do
  i=$((i+1)); echo "=== [$i] $cmd"
  bash -c "$cmd" 2>&1 | tee "$OUT/run$i.log" | grep -v "^W[0-9]" | tail -40
done
