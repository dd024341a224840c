# One device call: the AdamW kernel's GPU tests, the optimizer probe (bf16 gradients read as they are against fp32
# copies), then benchmarks/main_grads_bf16_one_gpu.yaml (fp32 against bf16 gradient buffers).
#   bash benchmarks/main_grads_bf16_run.sh   (on the GPU machine, OUT set)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 200 python3 -m pytest -q -m gpu tests/optim/test_precision_aware_optimizer.py tests/optim/test_fused_adamw_gpu.py 2>&1 | tail -8
PROBE_LAYERS=14 timeout 120 python3 benchmarks/optimizer_probe.py 2>&1 | tail -12
timeout ${BENCH_TIMEOUT:-420} python3 -m meshtron bench --matrix benchmarks/main_grads_bf16_one_gpu.yaml --warmup 3 --steps 8 \
  --no-split --record $OUT/rows.jsonl > $OUT/bench.log 2>&1
grep -v "^\[" $OUT/bench.log | tail -14
