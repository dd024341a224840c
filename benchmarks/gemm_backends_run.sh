# One device call: benchmarks/gemm_backends_one_gpu.yaml with the default GEMMs (cuBLAS as torch picks it),
# cuBLASLt for every GEMM (TORCH_BLAS_PREFER_CUBLASLT=1), and inductor's max-autotune (Triton GEMM templates
# benchmarked against cuBLAS per shape, TORCHINDUCTOR_MAX_AUTOTUNE=1; llama3-1b only: autotuning takes minutes).
#   bash benchmarks/gemm_backends_run.sh   (on the GPU machine, OUT set; llama3-3b needs more than 80 GB)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
M=benchmarks/gemm_backends_one_gpu.yaml
run() {  # name, timeout, environment...
  local name=$1 limit=$2; shift 2
  env "$@" timeout $limit python3 -m meshtron bench --matrix $M --warmup 2 --steps 4 --no-split \
    --record $OUT/$name.jsonl > $OUT/$name.log 2>&1
  echo "== $name"; grep -v "^\[" $OUT/$name.log | tail -3
}
run default 200 X=1
run cublaslt 200 TORCH_BLAS_PREFER_CUBLASLT=1
grep -v llama3-3b $M > /tmp/m1.yaml; M=/tmp/m1.yaml
run max_autotune 280 TORCHINDUCTOR_MAX_AUTOTUNE=1
