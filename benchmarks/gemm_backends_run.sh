# One device call: benchmarks/gemm_backends_one_gpu.yaml with the default GEMMs (cuBLAS as torch picks it),
# cuBLASLt for every GEMM (TORCH_BLAS_PREFER_CUBLASLT=1), and inductor's max-autotune (Triton GEMM templates
# benchmarked against cuBLAS per shape, TORCHINDUCTOR_MAX_AUTOTUNE=1; llama3-1b only: autotuning takes minutes).
#   bash benchmarks/gemm_backends_run.sh   (on the GPU machine, OUT set; under 100 GB llama3-3b runs at micro batch 2)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
M=/tmp/gemm_backends.yaml; cp benchmarks/gemm_backends_one_gpu.yaml $M
if ! python3 -c "import torch,sys; sys.exit(torch.cuda.get_device_properties(0).total_memory < 100e9)"; then
  sed -i 's/model: llama3-3b, micro_batch_size: 4, global_batch_size: 4/model: llama3-3b, micro_batch_size: 2, global_batch_size: 2/' $M
fi
run() {  # name, timeout, environment...
  local name=$1 limit=$2; shift 2
  env "$@" timeout $limit python3 -m meshtron bench --matrix $M --warmup 2 --steps 4 --no-split \
    --record $OUT/$name.jsonl > $OUT/$name.log 2>&1
  echo "== $name"; grep -v "^\[" $OUT/$name.log | tail -3
}
run default 200 X=1
run cublaslt 200 TORCH_BLAS_PREFER_CUBLASLT=1
sed -i '/llama3-3b/d' $M
run max_autotune 280 TORCHINDUCTOR_MAX_AUTOTUNE=1
