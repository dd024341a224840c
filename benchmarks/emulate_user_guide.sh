# One device call: every pipeline stage of the user guide's layouts (../shared/reference/megatron-core-user-guide.md)
# and of the published Megatron-Bridge ones, emulated on this GPU (meshtron emulate), rows to $OUT/emulated.jsonl.
#   bash benchmarks/emulate_user_guide.sh [names...]   (on the GPU machine, OUT set; names: see the case list)
# Steps run --measure-micro-batches micro-batches and are scaled to the job's count (docs/emulation.md).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
common="--bf16 --seq-length 4096 --micro-batch-size 1 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
declare -A CASE
CASE[llama2-7b-dp8]="--world-size 8 --model llama2-7b $common --global-batch-size 1024"
CASE[llama2-13b-tp2dp4]="--world-size 8 --model llama2-13b $common --tensor-model-parallel-size 2 --sequence-parallel --global-batch-size 1024"
CASE[llama3-70b-tp4pp4dp4]="--world-size 64 --model llama3-70b $common --tensor-model-parallel-size 4 --sequence-parallel --pipeline-model-parallel-size 4 --global-batch-size 1024"
CASE[llama3-405b-tp8pp8cp2]="--world-size 128 --model llama3-405b $common --tensor-model-parallel-size 8 --sequence-parallel --pipeline-model-parallel-size 8 --context-parallel-size 2 --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split --global-batch-size 1024"
CASE[mixtral-8x7b-tp2ep4dp4]="--world-size 32 --model mixtral-8x7b $common --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 4 --global-batch-size 1024"
# Published Megatron-Bridge layouts (H100, FP8, seq 8192): 1,664 and 326 tok/s/GPU.
fp8="--bf16 --fp8-format e4m3 --seq-length 8192 --micro-batch-size 1 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
CASE[bridge-llama3-70b-fp8]="--world-size 64 --model llama3-70b $fp8 --tensor-model-parallel-size 4 --sequence-parallel --pipeline-model-parallel-size 8 --virtual-pipeline-model-parallel-size 5 --global-batch-size 256"
CASE[bridge-llama3-405b-fp8]="--world-size 1024 --model llama3-405b $fp8 --tensor-model-parallel-size 8 --sequence-parallel --pipeline-model-parallel-size 8 --virtual-pipeline-model-parallel-size 8 --context-parallel-size 2 --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split --global-batch-size 1536"
# The guide's table (TP=8 PP=8 CP=2 DP=2: 256 GPUs; its text says 128 with DP=1, which does not fit 80 GB).
CASE[llama3-405b-tp8pp8cp2dp2]="--world-size 256 --model llama3-405b $common --tensor-model-parallel-size 8 --sequence-parallel --pipeline-model-parallel-size 8 --context-parallel-size 2 --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split --global-batch-size 1024"
# DeepSeek-V3 (Megatron-Bridge: TP=2 PP=8 VP=4 EP=64, 1,297 tok/s/GPU): 61 layers do not split into 8 x 4 equal
# chunks, and meshtron has no per-chunk layout string, so PP=8 without VP, the last stage 5 layers; experts split
# over the TP ranks (meshtron's expert TP equals TP); forced balanced routing (dropless).
CASE[bridge-deepseek-v3]="--world-size 1024 --model deepseek-v3 $common --recompute-granularity selective --global-batch-size 8192 --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 8 --decoder-last-pipeline-num-layers 5 --expert-model-parallel-size 64 --moe-router-force-load-balancing"
# A million tokens of llama3-8b (SPPO, 2026: Megatron-LM runs out of memory past 896K tokens for a 7B GPT).
long="--model llama3-8b --bf16 --seq-length 1048576 --micro-batch-size 1 --global-batch-size 1 --use-distributed-optimizer --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
CASE[llama3-8b-1m-cp8]="--world-size 8 $long --context-parallel-size 8 --optimizer-cpu-offload --offload-activations"
CASE[llama3-8b-1m-cp32]="--world-size 32 $long --context-parallel-size 32"
CASE[llama3-8b-1m-tp4cp8]="--world-size 32 $long --context-parallel-size 8 --tensor-model-parallel-size 4 --sequence-parallel"
# Two-GPU rows of benchmarks/measured.jsonl (two H200s) that one H100 holds: the emulated rank's peak against the
# measured rank's (rows c6, d24, e14, c17; same flags, same global batch).
CASE[row-c6]="--world-size 2 --model llama3-3b --seq-length 4096 --bf16 --micro-batch-size 4 --global-batch-size 4 --tensor-model-parallel-size 2 --sequence-parallel --no-release-grad-buffer"
CASE[row-d24]="--world-size 2 --model llama3-3b --seq-length 4096 --bf16 --micro-batch-size 2 --global-batch-size 64 --pipeline-model-parallel-size 2 --no-overlap-p2p-comm --no-release-grad-buffer"
CASE[row-e14]="--world-size 2 --model mixtral-8x7b --num-layers 4 --seq-length 4096 --bf16 --micro-batch-size 2 --global-batch-size 4 --expert-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --no-release-grad-buffer --emulate-routing data"
# Micro-batches per measured step: at least those that reach the job's steady state (meshtron emulate raises
# the count to that: runner.steady_state_micro_batches), so that the measured peak is the job's.
declare -A MBS
MBS[row-d24]=32
MBS[row-c6]=1
MBS[row-e14]=1
# Steps of minutes (a million tokens): one timed step, no warm-up, each pass of the split run once.
declare -A WARMUP STEPS SPLIT
for n in llama3-8b-1m-cp8 llama3-8b-1m-cp32 llama3-8b-1m-tp4cp8; do WARMUP[$n]=0; STEPS[$n]=1; SPLIT[$n]=1; done
# Which ranks: the first and the last pipeline stage where the middle ones repeat the first's layers.
declare -A RANKS
RANKS[llama3-70b-tp4pp4dp4]="0,48"
RANKS[llama3-405b-tp8pp8cp2]="0,112"
RANKS[llama3-405b-tp8pp8cp2dp2]="0,224"
RANKS[bridge-llama3-70b-fp8]="0,56"
RANKS[bridge-llama3-405b-fp8]="0,896"
RANKS[row-d24]="0,1"
RANKS[bridge-deepseek-v3]="0,896"
RANKS[llama3-8b-1m-cp8]="0"
RANKS[llama3-8b-1m-cp32]="0"
RANKS[llama3-8b-1m-tp4cp8]="0"
RANKS[row-c6]="0"
RANKS[row-e14]="0"
names=${*:-llama2-7b-dp8 llama2-13b-tp2dp4 llama3-70b-tp4pp4dp4 mixtral-8x7b-tp2ep4dp4 llama3-405b-tp8pp8cp2}
for name in $names; do
  echo "== $name"
  timeout ${CASE_TIMEOUT:-240} python3 -m meshtron emulate ${CASE[$name]} --ranks ${RANKS[$name]:-stages} \
    --measure-micro-batches ${MBS[$name]:-${MB:-2}} --warmup ${WARMUP[$name]:-1} --steps ${STEPS[$name]:-2} --split-repeats ${SPLIT[$name]:-3} \
    --json --out $OUT/emulated.jsonl > $OUT/$name.log 2>&1
  echo "rc=$?"; grep -v '^{' $OUT/$name.log | grep -v "^\[" | tail -4
  python3 - "$OUT/$name.log" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    if line.startswith("{"):
        r = json.loads(line)
        if "error" in r:
            print(f"rank {r['rank']}: {r['error'][:100]}"); continue
        m, p, pl = r["measured"], r["predicted"], r["planner"]
        print(f"rank {r['rank']} stage {r['coordinates']['pp']}: peak {m['peak_mem_gib']:.1f} GiB (planner est {pl['est_mem_gib']:.1f}), "
              f"fwd {m['forward_s']*1e3:.0f} bwd {m['backward_s']*1e3:.0f} opt {m['optimizer_s']*1e3:.0f} ms per {r['measured_micro_batches']} mb; "
              f"predicted step {p['step_s']:.2f} s, {p['tokens_per_sec_per_gpu']:,.0f} tok/s/GPU; planner step {pl['step_s'] or float('nan'):.2f} s")
PY
done
