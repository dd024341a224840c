#!/usr/bin/env bash
# torchtitan 0.2.2 (the peer) on meshtron's MoE benchmark shapes, one GPU, one device call:
#   OUT=$OUT bash benchmarks/peers_side_by_side.sh
# Rows (benchmarks/peers_torchtitan.py has the shapes and what is torchtitan's and what is the harness):
#   dsv3_width_mbs2, qwen3_30b_a3b_mbs4, gpt_oss_20b_mbs1, gpt_oss_20b_mbs2, dsv3_width_fp8_experts_mbs2,
#   dsv3_width_fp8_linear_mbs2, dsv3_width_fp8_both_mbs2
# Each row runs in its own process under a timeout (PEERS_ROW_TIMEOUT_S, default 120 s; the first gpt-oss row
# PEERS_GPT_OSS_FIRST_TIMEOUT_S, default 170 s) inside a total budget
# (PEERS_DEADLINE_S, default 500 s, counted from the start of this script); a row that would get less than
# 40 s is skipped. Prints one `PEER <row> tok/s ... peak_GiB ...` line per row (full logs in $OUT/<row>.log).
# PEERS_ROWS="row1 row2" picks rows. PEERS_CPU_TINY=1 runs each row's tiny CPU check instead (a self-test of
# this script without a GPU; its numbers mean nothing).
#
# Wheels, prepared where PyPI is reachable, in the repository root (.whl/ is git-ignored):
#   python3 -m pip download --no-deps -d .whl torchtitan==0.2.2
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl torchao==0.18.0     # only for the FP8 row
# The GPU image (torch 2.11 + CUDA 13, Python 3.12) lacks torchtitan, torchao, torchdata, datasets and tyro;
# the last three are stubbed by the harness (imported by torchtitan, unused on the measured path).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/peers_out}
mkdir -p "$OUT"
start=$SECONDS
DEADLINE=${PEERS_DEADLINE_S:-500}
ROW_TIMEOUT=${PEERS_ROW_TIMEOUT_S:-120}
ROWS=${PEERS_ROWS:-"dsv3_width_mbs2 qwen3_30b_a3b_mbs4 gpt_oss_20b_mbs1 gpt_oss_20b_mbs2 dsv3_width_fp8_experts_mbs2"}

ls .whl/*.whl >/dev/null 2>&1 || { echo "peers_side_by_side: no wheels in .whl/ (see the header)"; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "peers_side_by_side: wheel install failed"; exit 2; }
export PYTHONPATH=/tmp/site:$PWD
python3 - <<'EOF'
import torch
print(f"PEER env torch {torch.__version__} cuda {torch.version.cuda} "
      f"gpu {torch.cuda.get_device_name() if torch.cuda.is_available() else None!r}", flush=True)
EOF
extra=(); [ "${PEERS_CPU_TINY:-0}" = 1 ] && extra=(--tiny)
have_torchao=0; ls .whl/torchao-*.whl >/dev/null 2>&1 && have_torchao=1

run_row() {  # run_row NAME [extra args]; returns the row's exit status
    local name=$1; shift
    local left=$((DEADLINE - (SECONDS - start)))
    local cap=$ROW_TIMEOUT
    # the first gpt-oss row compiles FlexAttention (torchtitan asks for max-autotune there): give it more time
    [ "$name" = gpt_oss_20b_mbs1 ] && cap=${PEERS_GPT_OSS_FIRST_TIMEOUT_S:-170}
    local t=$((left < cap ? left : cap))
    if [ "$t" -lt 40 ]; then echo "PEER $name skipped (time budget: ${left}s left)"; return 3; fi
    local t0=$SECONDS
    timeout -k 5 "$t" python3 benchmarks/peers_torchtitan.py --row "$name" ${extra[@]+"${extra[@]}"} "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    if grep -q '^PEER ' "$OUT/$name.log"; then
        grep '^PEER ' "$OUT/$name.log" | sed "s/\$/ wall_s $((SECONDS - t0)) $*/"
    else
        echo "PEER $name failed rc $rc after $((SECONDS - t0))s (timeout ${t}s) $*"
        grep -v '^\s*\^*\s*$' "$OUT/$name.log" | tail -n 12 | cut -c1-300
    fi
    return $rc
}

gpt_oss_flags=()
for row in $ROWS; do
    case $row in
        *fp8*)
            if [ "$have_torchao" = 1 ]; then run_row "$row"; else echo "PEER $row skipped (no torchao wheel)"; fi ;;
        gpt_oss*)
            run_row "$row" ${gpt_oss_flags[@]+"${gpt_oss_flags[@]}"}
            rc=$?
            if [ "$rc" != 0 ] && [ "$rc" != 3 ] && [ "$rc" != 124 ] && [ ${#gpt_oss_flags[@]} = 0 ]; then
                # per-block compile of gpt-oss is the harness's addition (torchtitan 0.2.2 does not compile its
                # blocks): if it fails (not a timeout), measure torchtitan's gpt-oss as shipped for this and later rows.
                gpt_oss_flags=(--gpt-oss-as-shipped)
                run_row "$row" ${gpt_oss_flags[@]+"${gpt_oss_flags[@]}"}
            fi ;;
        *)
            run_row "$row" ;;
    esac
done
echo "PEER done total_s $((SECONDS - start))"
