# Migration proof on one GPU: Megatron-LM (core_v0.19.0's pretrain_gpt.py, local layer spec, no Transformer Engine
# or apex) and meshtron continue each other's checkpoints, and the losses of the iterations after the hand-over are
# compared with those of the run that did not change hands.
#
#   Megatron trains 20 iterations and saves at 10   ->  meshtron loads iteration 10 and trains 11-20
#     dense: torch_dist with the distributed optimizer's default buckets (dp_reshardable), torch_dist fully
#            reshardable (--dist-ckpt-optim-fully-reshardable), legacy (--ckpt-format torch: distrib_optim.pt)
#     MoE (4 experts, top-2, aux loss): the same three
#   meshtron trains 10 of 20 iterations (--exit-interval 10: the schedule is that of 20, which Megatron checks),
#   saves and exports (--export-megatron)  ->  Megatron loads and trains 11-20,
#     beside meshtron continuing from its own checkpoint (dense and MoE).
#
# Both read the same .bin/.idx (meshtron's default corpus through NullTokenizer ids) in Megatron's sample order
# (--data-order megatron), dropout 0, bf16. Independent runs share the GPU (tiny models) to fit one device call.
#
# Needs Megatron-LM's source in .mlm/ (ignored by git; carry it): from the repository at tag core_v0.19.0,
#   git archive core_v0.19.0 megatron pretrain_gpt.py gpt_builders.py model_provider.py | tar -x -C .mlm
# plus megatron/core/datasets/helpers_cpp.cpython-312-x86_64-linux-gnu.so from the megatron-core 0.19.2 wheel
# (the same helpers.cpp), so that nothing is compiled there.
#   run: OUT=$OUT bash benchmarks/megatron_continuation.sh        (carry: .mlm)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
W=${MIGRATION_WORK:-/tmp/migration}; rm -rf "$W"; mkdir -p "$W"
MLM=$PWD/.mlm
[ -f "$MLM/pretrain_gpt.py" ] || { echo "no Megatron-LM source in .mlm (see the header)"; exit 2; }
if ! command -v make >/dev/null; then  # Megatron runs `make` on its dataset helpers: already built, nothing to do
  mkdir -p /tmp/shim && printf '#!/bin/sh\nexit 0\n' >/tmp/shim/make && chmod +x /tmp/shim/make
  export PATH=/tmp/shim:$PATH
fi
touch "$MLM"/megatron/core/datasets/helpers_cpp*.so
nvidia-smi --query-gpu=name --format=csv,noheader
PREFIX=$(python3 -c "from meshtron.data.default_corpus import ensure_default_corpus as e; print(e().prefix)") || exit 1

MODEL="--num-layers 4 --hidden-size 256 --ffn-hidden-size 704 --num-attention-heads 8 --group-query-attention
  --num-query-groups 2 --seq-length 512 --max-position-embeddings 512 --position-embedding-type rope
  --rotary-base 10000 --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --untie-embeddings-and-output-weights
  --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
  --tokenizer-type NullTokenizer --vocab-size 2048 --make-vocab-size-divisible-by 128"
MOE="--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 352 --moe-token-dispatcher-type alltoall
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2"
TRAIN="--micro-batch-size 4 --global-batch-size 16 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine
  --lr-warmup-iters 4 --lr-decay-iters 20 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
  --bf16 --seed 1234 --data-path $PREFIX --split 98,2,0 --eval-iters 0 --eval-interval 1000 --log-interval 1"
MEGATRON_ONLY="--transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion
  --no-rope-fusion --no-persist-layer-norm --no-bias-swiglu-fusion --use-distributed-optimizer
  --data-cache-path $W/megatron_cache"
RESUMABLE=$PWD/benchmarks/megatron_pretrain_no_te.py  # pretrain_gpt.py, resuming without TE or Apex (see it)
megatron() {  # name, then flags; --standalone: each run on a free port (runs share the machine)
  local name=$1; shift
  (cd "$MLM" && timeout 420 torchrun --standalone --nproc-per-node 1 "$RESUMABLE" $MODEL $TRAIN \
    $MEGATRON_ONLY "$@") >"$W/$name.log" 2>&1
  echo "megatron $name: exit $? ($(grep -c 'lm loss' "$W/$name.log") iterations logged)"
}
meshtron() {  # name, then flags
  local name=$1; shift
  timeout 300 python3 -m meshtron train $MODEL $TRAIN --data-order megatron --transformer-impl local \
    --metrics-file "$W/$name.jsonl" \
    "$@" >"$W/$name.log" 2>&1
  echo "meshtron $name: exit $?"
}

# ONLY=fixtures: tiny checkpoints saved by Megatron-LM's own training loop (2 layers of hidden 64, 2 iterations;
# torch_dist dp_reshardable, legacy, and a MoE model fully reshardable), packed into $OUT/megatron_lm_fixtures.tar.gz
# to be committed as test fixtures (what Megatron-LM's save holds beyond megatron-core's: its args, the rerun state
# machine, the scheduler).
if [ "${ONLY:-}" = fixtures ]; then
  TINY="--num-layers 2 --hidden-size 64 --ffn-hidden-size 176 --num-attention-heads 4 --train-iters 2 --save-interval 2"
  megatron lm_dist $TINY --save "$W/lm_dist" --ckpt-format torch_dist &
  megatron lm_legacy $TINY --save "$W/lm_legacy" --ckpt-format torch &
  megatron lm_moe $TINY $MOE --moe-ffn-hidden-size 64 --save "$W/lm_moe" --ckpt-format torch_dist \
    --dist-ckpt-optim-fully-reshardable &
  wait
  tar -C "$W" -czf "$OUT/megatron_lm_fixtures.tar.gz" lm_dist lm_legacy lm_moe && ls -l "$OUT/megatron_lm_fixtures.tar.gz"
  for f in "$W"/lm_*.log; do grep "rank0\]: [A-Za-z.]*Error" "$f" | tail -2; done
  exit 0
fi

# ONLY=dense (the dense cases and the reverse), ONLY=moe (the MoE cases: torch_dist both formats, legacy, reverse),
# ONLY=reverse (meshtron -> Megatron, dense), ONLY=moe_reverse (the same for the MoE model): parts of the whole,
# each small enough for a short device call.
part() { [ -z "${ONLY:-}" ] || [ "${ONLY:-}" = "$1" ] || { [ "$1" = dense ] && [ "${ONLY:-}" = reverse ]; } ||
  { [ "$1" = moe ] && [ "${ONLY:-}" = moe_reverse ]; }; }
both() { [ -z "${ONLY:-}" ] || [ "${ONLY:-}" = "$1" ]; }  # runs of the forward direction only

echo "== phase 1: Megatron saves at 10 (and runs on to 20); meshtron trains 10 of 20 and exports"
if both dense; then
  megatron mg_dense_dist --train-iters 20 --save "$W/mg_dense_dist" --save-interval 10 --ckpt-format torch_dist &
  megatron mg_dense_full --train-iters 20 --save "$W/mg_dense_full" --save-interval 10 --ckpt-format torch_dist \
    --dist-ckpt-optim-fully-reshardable &
  megatron mg_dense_legacy --train-iters 20 --save "$W/mg_dense_legacy" --save-interval 10 --ckpt-format torch &
fi
if part dense; then
  meshtron ms_dense_first --train-iters 20 --exit-interval 10 --save "$W/ms_dense" --export-megatron "$W/ms_to_mg" &
fi
if both moe; then
  megatron mg_moe_dist $MOE --train-iters 20 --save "$W/mg_moe_dist" --save-interval 10 --ckpt-format torch_dist &
  megatron mg_moe_full $MOE --train-iters 20 --save "$W/mg_moe_full" --save-interval 10 --ckpt-format torch_dist \
    --dist-ckpt-optim-fully-reshardable &
  megatron mg_moe_legacy $MOE --train-iters 20 --save "$W/mg_moe_legacy" --save-interval 10 --ckpt-format torch &
fi
if part moe; then
  meshtron ms_moe_first $MOE --train-iters 20 --exit-interval 10 --save "$W/ms_moe" --export-megatron "$W/ms_moe_to_mg" &
fi
wait

echo "== phase 2: each continues the other's iteration 10"
if both dense; then
  for kind in dense_dist dense_full dense_legacy; do
    meshtron ms_from_$kind --train-iters 20 --load "$W/mg_$kind/iter_0000010" &
  done
fi
if part dense; then
  megatron mg_from_ms --train-iters 20 --load "$W/ms_to_mg" --ckpt-format torch_dist --no-load-rng &
  meshtron ms_dense_self --train-iters 20 --load "$W/ms_dense" &
fi
if both moe; then
  for kind in moe_dist moe_full moe_legacy; do
    meshtron ms_from_$kind $MOE --train-iters 20 --load "$W/mg_$kind/iter_0000010" &
  done
fi
if part moe; then
  megatron mg_from_ms_moe $MOE --train-iters 20 --load "$W/ms_moe_to_mg" --ckpt-format torch_dist --no-load-rng &
  meshtron ms_moe_self $MOE --train-iters 20 --load "$W/ms_moe" &
fi
wait

echo "== losses of iterations 11-20"
python3 benchmarks/megatron_continuation_compare.py "$W" --out "$OUT/megatron_continuation.jsonl"
tar -C "$W" -czf "$OUT/megatron_continuation_logs${ONLY:+_$ONLY}.tar.gz" $(cd "$W" && ls *.log *.jsonl 2>/dev/null)  # one file: few come back
for f in "$W"/*.log; do  # Megatron's own error lines first (torchrun's wrapper traceback says nothing)
  grep -q "Traceback\|error" "$f" && { echo "--- $(basename "$f")"; grep "rank0\]: [A-Za-z.]*Error" "$f" | tail -3
    grep -B2 -A12 "Traceback\|rror" "$f" | grep -v "^  [a-z_0-9]* \.\.\." | tail -12; }; done
exit 0
