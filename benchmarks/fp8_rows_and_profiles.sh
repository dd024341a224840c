# One device call: the FP8 rows of the speed issue before (.before/, an earlier package, carried) and after, then
# kernel profiles (benchmarks/profile_step.py) of the rows furthest from their aims: llama3-3b FP8 and the
# DeepSeek-V3 width. Output under $OUT; the bench rows also into $OUT/{before,after}.jsonl.
#   bash benchmarks/fp8_rows_and_profiles.sh   (on the GPU machine, OUT set; an H200 runs llama3-3b at micro batch 4)
export PYTHONUNBUFFERED=1 PROFILE_ROWS=45
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
M=benchmarks/fp8_swiglu_one_gpu.yaml
for v in before after; do
  if [ $v = before ]; then P=$PWD/.before; else P=$PWD; fi
  [ -d "$P/meshtron" ] || continue
  PYTHONPATH=$P timeout 170 python3 -m meshtron bench --matrix $M --warmup 2 --steps 4 --no-split --record $OUT/$v.jsonl 2>&1 | grep -v "^\[" | tail -6
done
export PYTHONPATH=$PWD B="--bf16 --seq-length 4096"
timeout 110 python3 benchmarks/profile_step.py --model llama3-3b --bf16 --seq-length 4096 --micro-batch-size 4 --global-batch-size 4 --fp8-format e4m3 > $OUT/p3b_fp8.txt 2>&1; tail -14 $OUT/p3b_fp8.txt
timeout 110 bash -c "$(grep -o 'python3 benchmarks/profile_step.py --model deepseek-moe-16b.*--global-batch-size 2' benchmarks/profile_rows.sh)" > $OUT/pdsv3.txt 2>&1; tail -14 $OUT/pdsv3.txt
