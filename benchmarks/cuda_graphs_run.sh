# One device call: the GPU tests of --enable-cuda-graph, then benchmarks/cuda_graphs_one_gpu.yaml's rows ROWS
# (a sed range of its row lines, default all; on a GPU under 100 GB llama3-3b runs at micro batch 2).
#   ROWS=1,4 bash benchmarks/cuda_graphs_run.sh   (on the GPU machine, OUT set)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${TESTS:-1}" = 1 ]; then
  timeout 240 python3 -m pytest -q -x -m gpu tests/training/test_cuda_graphs.py 2>&1 | tail -15
fi
M=/tmp/cuda_graphs.yaml
{ sed -n '/^base:/,/^rows:/p' benchmarks/cuda_graphs_one_gpu.yaml; grep '^  - ' benchmarks/cuda_graphs_one_gpu.yaml | sed -n "${ROWS:-1,\$}p"; } > $M
if ! python3 -c "import torch,sys; sys.exit(torch.cuda.get_device_properties(0).total_memory < 100e9)"; then
  sed -i 's/model: llama3-3b, micro_batch_size: 4, global_batch_size: 4/model: llama3-3b, micro_batch_size: 2, global_batch_size: 2/' $M
fi
cat $M
# perf_hints logs each region that torch.compile could not capture as a graph, and why.
TORCH_LOGS=perf_hints timeout ${BENCH_TIMEOUT:-500} python3 -m meshtron bench --matrix $M --warmup 2 --steps 4 \
  --no-split --record $OUT/rows.jsonl > $OUT/bench.log 2>&1
grep -i "cudagraph" $OUT/bench.log | sort | uniq -c | head -20; grep -v "^\[" $OUT/bench.log | tail -14
