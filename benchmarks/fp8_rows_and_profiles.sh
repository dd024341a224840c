# One device call: the FP8 rows of the speed issue at an earlier package (.before/, carried; skipped when absent),
# then at this tree with and without CUDA graphs (benchmarks/cuda_graphs_run.sh, rows 1-4), then a kernel
# profile (benchmarks/profile_step.py) of llama3-3b FP8. Output under $OUT.
#   bash benchmarks/fp8_rows_and_profiles.sh   (on the GPU machine, OUT set; an H200 runs llama3-3b at micro batch 4)
export PYTHONUNBUFFERED=1 PROFILE_ROWS=45
if [ -d .before/meshtron ]; then
  PYTHONPATH=$PWD/.before timeout 170 python3 -m meshtron bench --matrix benchmarks/fp8_swiglu_one_gpu.yaml --warmup 2 \
    --steps 4 --no-split --record $OUT/before.jsonl 2>&1 | grep -v "^\[" | tail -4
fi
TESTS=0 ROWS=1,4 BENCH_TIMEOUT=240 bash benchmarks/cuda_graphs_run.sh
M3=$(python3 -c "import torch;print(4 if torch.cuda.get_device_properties(0).total_memory>100e9 else 2)")
PYTHONPATH=$PWD timeout 120 python3 benchmarks/profile_step.py --model llama3-3b --bf16 --seq-length 4096 \
  --micro-batch-size $M3 --global-batch-size $M3 --fp8-format e4m3 > $OUT/p3b_fp8.txt 2>&1; tail -14 $OUT/p3b_fp8.txt
