# The fused FP8 SwiGLU block on one GPU: its GPU tests, the block probe, then the FP8 rows before (.before/, the
# package at the previous code, carried) and after. On a GPU under 100 GB llama3-3b runs at micro batch 2.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
M=benchmarks/fp8_swiglu_one_gpu.yaml
if ! python3 -c "import torch,sys; sys.exit(torch.cuda.get_device_properties(0).total_memory < 100e9)"; then
  sed 's/{model: llama3-3b, micro_batch_size: 4, global_batch_size: 4}/{model: llama3-3b, micro_batch_size: 2, global_batch_size: 2}/' $M > /tmp/m.yaml; M=/tmp/m.yaml
fi
PYTHONPATH=$PWD timeout 200 python3 -m pytest -q -x -m gpu tests/training/test_fp8_gpu.py 2>&1 | tail -15
PYTHONPATH=$PWD timeout 150 python3 benchmarks/fp8_swiglu_probe.py 2>&1 | tail -8
for v in before after; do
  if [ $v = before ]; then P=$PWD/.before; else P=$PWD; fi
  PYTHONPATH=$P timeout 240 python3 -m meshtron bench --matrix $M --warmup 2 --steps 4 --no-split --record $OUT/$v.jsonl 2>&1 | grep -v "^\[" | tail -6
done
