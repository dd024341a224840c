# One device call for the emulation issue: layouts at scale (benchmarks/emulate_user_guide.sh CASES), then
# emulation against the recorded one-GPU rows of this GPU's kind (benchmarks/emulation_accuracy.py).
#   CASES="..." ACCURACY=8 bash benchmarks/emulation_call.sh   (on the GPU machine, OUT set)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
[ -n "${CASES}" ] && bash benchmarks/emulate_user_guide.sh ${CASES}
if [ -n "${ACCURACY}" ]; then
  kind=nvidia-h100-x1; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && kind=nvidia-h200
  timeout ${ACCURACY_TIMEOUT:-240} python3 benchmarks/emulation_accuracy.py --device-kind $kind --limit ${ACCURACY} \
    --out $OUT/accuracy.jsonl 2>&1 | grep -v "^\[" | tail -$((ACCURACY + 4))
fi
