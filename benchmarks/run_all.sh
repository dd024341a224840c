#!/usr/bin/env bash
# The whole GPU benchmark matrix of meshtron in three calls on a two-H200 machine (nvidia-h200-x2),
# each well inside 10 minutes. Rows go to $OUT/rows.jsonl (two-GPU launches) and $OUT/rows_gpuN.jsonl
# (one-GPU launches, run side by side on the two GPUs); the console shows one line per row.
#   bash benchmarks/run_all.sh parallel   # llama3-8b on two GPUs (TP=2, DP=2), TP=2 and DP=2 on llama3-3b
#   bash benchmarks/run_all.sh single     # FP8 and recomputation, one GPU each, side by side
#   bash benchmarks/run_all.sh pipeline   # PP=2: 1F1B and interleaved, 8 and 32 micro-batches
#   bash benchmarks/run_all.sh fp8        # FP8 rows on GPU 1; FP8 cast timings, kernel profiles of llama3-3b FP8 and bf16 on GPU 0
#   bash benchmarks/run_all.sh fp8tp      # llama3-8b TP=2 + SP: FP8 against bf16, async TP on and off
#   bash benchmarks/run_all.sh fp8tpprof  # kernel profiles of llama3-8b TP=2 + SP (async TP), FP8 and bf16
#   bash benchmarks/run_all.sh fp8batch   # llama3-8b TP=2 + SP: bf16 and FP8 at the micro batches that fit
#   bash benchmarks/run_all.sh fp8batch1  # llama3-3b, FP8 and bf16 at micro batches 4 and 6, the same matrix on each GPU
#   bash benchmarks/run_all.sh fp8host    # host-operator profile and Chrome trace of llama3-8b TP=2 + SP FP8
#   bash benchmarks/run_all.sh accumulate # llama3-8b on two GPUs with several micro-batches per step
#   bash benchmarks/run_all.sh p2p        # PP=2 at 32 micro-batches: overlapped transfers, balanced split
#   bash benchmarks/run_all.sh async      # llama3-8b with micro-pipelined TP; then the one-GPU bf16 rows
#   bash benchmarks/run_all.sh memory     # allocation sites at the peak (FP8, full recomputation), one GPU
#   bash benchmarks/run_all.sh tests      # the GPU tests (NCCL, compiled layers, grouped GEMM)
#   bash benchmarks/run_all.sh moe        # Mixtral-shaped, EP=2
#   bash benchmarks/run_all.sh cp         # context parallelism 32K-128K, CP=2 against CP=1
#   bash benchmarks/run_all.sh four       # on nvidia-h200-x4: 3-D llama3-8b, DP=4 scaling
#   bash benchmarks/run_all.sh eight      # on nvidia-h200-x8: 3-D llama3-8b, 70B shape, EP=8, CP=8 at 128K
# Several phases may be named in one call (bash benchmarks/run_all.sh single pipeline).
# Every launch has its own time limit, so that a hung or failed row cannot take the whole call.
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  git rev-parse --short HEAD 2>/dev/null; } 2>&1 | tee -a "$OUT/env.txt"

gpus() {  # gpus N SECONDS MATRIX [bench flags...]
  local n=$1 limit=$2 matrix=$3; shift 3
  echo "=== $n GPUs: $matrix $*  (limit ${limit}s, $(date +%T))"
  timeout "$limit" torchrun --nproc-per-node "$n" -m meshtron bench --matrix "benchmarks/$matrix" --json \
    --out "$OUT/rows.jsonl" "$@" --distributed-timeout-minutes 2 2>&1 | tee -a "$OUT/log.txt" \
    | grep -E '^\{|Error|error' | cut -c1-400
}
two_gpus() { gpus 2 "$@"; }
one_gpu() {  # one_gpu GPU SECONDS MATRIX [bench flags...]
  local gpu=$1 limit=$2 matrix=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpu timeout "$limit" python3 -m meshtron bench --matrix "benchmarks/$matrix" --json \
    --out "$OUT/rows_gpu$gpu.jsonl" "$@" > "$OUT/gpu$gpu.log" 2>&1
}

[ $# -gt 0 ] || set -- usage
for phase in "$@"; do
case "$phase" in
  parallel)
    two_gpus 330 llama3_8b_two_gpu.yaml --warmup 2 --steps 3
    two_gpus 150 tensor_parallel.yaml --warmup 2 --steps 3
    two_gpus 150 data_parallel.yaml --warmup 2 --steps 3 ;;
  single)
    echo "=== one GPU each: single_gpu_fp8.yaml | single_gpu_recompute.yaml ($(date +%T))"
    one_gpu 0 290 single_gpu_fp8.yaml --warmup 3 --steps 5 &
    one_gpu 1 290 single_gpu_recompute.yaml --warmup 3 --steps 5 &
    wait
    grep -hE '^\{|Error' "$OUT"/gpu*.log | cut -c1-400 ;;
  fp8)
    CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/fp8_cast_probe.py 2>&1 | tee "$OUT/fp8_cast_probe.txt"
    echo "=== one GPU each: kernel profiles | single_gpu_fp8.yaml ($(date +%T))"
    ( for prec in "--fp8-format e4m3" ""; do
        CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/profile_step.py --bf16 --model llama3-3b \
          --micro-batch-size 4 --global-batch-size 4 --seq-length 4096 $prec
      done > "$OUT/profiles.txt" 2>&1 ) &
    one_gpu 1 420 single_gpu_fp8.yaml --warmup 3 --steps 5 &
    wait
    grep -hE '^\{|Error' "$OUT"/gpu1.log | cut -c1-400 ;;
  fp8tp)
    two_gpus 560 llama3_8b_fp8.yaml --warmup 2 --steps 3 --no-split ;;
  fp8tpprof)
    for prec in "--fp8-format e4m3" ""; do
      echo "=== kernel profile, llama3-8b TP=2 + SP, async TP $prec ($(date +%T))"
      timeout 270 torchrun --nproc-per-node 2 benchmarks/profile_step.py --bf16 --model llama3-8b \
        --tensor-model-parallel-size 2 --sequence-parallel --async-tensor-parallel --micro-batch-size 4 \
        --global-batch-size 4 --seq-length 4096 $prec 2>&1 | tee -a "$OUT/profiles_tp.txt" | tail -10
    done ;;
  fp8batch)
    two_gpus 470 llama3_8b_fp8_batch.yaml --warmup 2 --steps 3 --no-split ;;
  fp8batch1)
    echo "=== one GPU each, the same matrix: single_gpu_fp8_batch.yaml ($(date +%T))"
    one_gpu 0 400 single_gpu_fp8_batch.yaml --warmup 3 --steps 5 --no-split &
    one_gpu 1 400 single_gpu_fp8_batch.yaml --warmup 3 --steps 5 --no-split &
    wait
    grep -hE '^\{|Error' "$OUT"/gpu*.log | cut -c1-400 ;;
  fp8host)
    echo "=== host profile, llama3-8b TP=2 + SP, async TP, FP8 ($(date +%T))"
    PROFILE_CPU=1 PROFILE_STEPS=1 PROFILE_TRACE=/tmp/trace_fp8.json timeout 300 torchrun --nproc-per-node 2 \
      benchmarks/profile_step.py --bf16 --model llama3-8b --tensor-model-parallel-size 2 --sequence-parallel \
      --async-tensor-parallel --micro-batch-size 4 --global-batch-size 4 --seq-length 4096 --fp8-format e4m3 \
      > "$OUT/host_profile.txt" 2>&1; tail -5 "$OUT/host_profile.txt"
    gzip -c /tmp/trace_fp8.json > "$OUT/trace_fp8.json.gz" ;;
  accumulate)
    two_gpus 420 llama3_8b_two_gpu_accumulation.yaml --warmup 2 --steps 3 --no-split ;;
  memory)
    one_gpu 0 300 memory_sites.yaml --warmup 1 --steps 1 --no-split --memory-sites
    grep -hE '^\{|Error' "$OUT"/gpu0.log | cut -c1-1500 ;;
  pipeline)
    two_gpus 420 pipeline.yaml --warmup 1 --steps 3 --no-split ;;
  async)
    two_gpus 300 llama3_8b_async_tp.yaml --warmup 2 --steps 3 --no-split
    echo "=== one GPU each: llama3-1b | llama3-3b bf16 ($(date +%T))"
    one_gpu 0 200 single_gpu_reference.yaml --warmup 3 --steps 6 --model llama3-1b --micro-batch-size 8 &
    one_gpu 1 200 single_gpu_reference.yaml --warmup 3 --steps 6 --model llama3-3b --micro-batch-size 4 &
    wait
    grep -hE '^\{|Error' "$OUT"/gpu*.log | cut -c1-400 ;;
  p2p)
    two_gpus 560 pipeline_overlap.yaml --warmup 1 --steps 2 --no-split ;;
  tests)
    echo "=== GPU tests ($(date +%T))"
    timeout 300 python3 -m pytest -q -p no:logging --tb=short -m gpu tests 2>&1 | tee -a "$OUT/tests.txt" \
      | grep -E "rank|Error|error|FAILED|passed|failed" | cut -c1-300 | head -60 ;;
  moe)
    two_gpus 170 moe_two_gpu.yaml --warmup 2 --steps 4 --profile-comm ;;
  cp)
    two_gpus 300 context_parallel.yaml --warmup 1 --steps 2 --no-split ;;
  four)
    gpus 4 540 four_gpu.yaml --warmup 2 --steps 4 --profile-comm ;;
  eight)
    gpus 8 560 eight_gpu.yaml --warmup 2 --steps 3 --profile-comm ;;
  *) echo "usage: bash benchmarks/run_all.sh parallel|single|fp8|fp8tp|fp8tpprof|fp8batch|fp8batch1|fp8host|accumulate|async|pipeline|p2p|memory|tests|moe|cp|four|eight ..." >&2; exit 2 ;;
esac
done
echo "=== done $(date +%T)"
