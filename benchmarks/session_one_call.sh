# One device call for the hardening and emulation issues: the AdamW kernel's GPU tests, --main-grads-dtype bf16
# rows (benchmarks/main_grads_bf16_one_gpu.yaml, ROWS as a sed range of its rows), then user-guide layouts
# emulated (benchmarks/emulate_user_guide.sh CASES).
#   ROWS=4,6 CASES="llama2-7b-dp8 llama3-70b-tp4pp4dp4" bash benchmarks/session_one_call.sh   (GPU machine, OUT set)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 120 python3 -m pytest -q -m gpu tests/optim/test_precision_aware_optimizer.py tests/optim/test_fused_adamw_gpu.py 2>&1 | tail -4
M=/tmp/main_grads.yaml
{ sed -n '/^base:/,/^rows:/p' benchmarks/main_grads_bf16_one_gpu.yaml; grep '^  - ' benchmarks/main_grads_bf16_one_gpu.yaml | sed -n "${ROWS:-1,\$}p"; } > $M
[ -n "${ROWS}" ] && timeout ${BENCH_TIMEOUT:-240} python3 -m meshtron bench --matrix $M --warmup 3 --steps 6 --no-split --record $OUT/rows.jsonl > $OUT/bench.log 2>&1
[ -n "${ROWS}" ] && grep -v "^\[" $OUT/bench.log | tail -8
[ -n "${CASES}" ] && bash benchmarks/emulate_user_guide.sh ${CASES}
