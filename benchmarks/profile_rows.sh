# Kernel profiles (benchmarks/profile_step.py) of the speed rows of one GPU, each into $OUT/<row>.txt:
# llama3-3b bf16 and FP8 e4m3, llama3-1b bf16, the DeepSeek-V3 width (micro batches halved on a GPU under 100 GB).
#   bash benchmarks/profile_rows.sh   (on the GPU machine, OUT set)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PROFILE_ROWS=45
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
BIG=$(python3 -c "import torch;print(1 if torch.cuda.get_device_properties(0).total_memory>100e9 else 0)")
if [ $BIG = 1 ]; then M3=4; M1=8; else M3=2; M1=4; fi
B="--bf16 --seq-length 4096"
python3 benchmarks/profile_step.py --model llama3-3b $B --micro-batch-size $M3 --global-batch-size $M3 > $OUT/p3b_bf16.txt 2>&1; tail -14 $OUT/p3b_bf16.txt
python3 benchmarks/profile_step.py --model llama3-3b $B --micro-batch-size $M3 --global-batch-size $M3 --fp8-format e4m3 > $OUT/p3b_fp8.txt 2>&1; tail -14 $OUT/p3b_fp8.txt
python3 benchmarks/profile_step.py --model llama3-1b $B --micro-batch-size $M1 --global-batch-size $M1 > $OUT/p1b_bf16.txt 2>&1; tail -14 $OUT/p1b_bf16.txt
python3 benchmarks/profile_step.py --model deepseek-moe-16b --num-layers 2 --vocab-size 129280 --hidden-size 7168 --num-attention-heads 128 --num-query-groups 128 --no-group-query-attention --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --ffn-hidden-size 18432 --num-experts 16 --moe-ffn-hidden-size 2048 --moe-router-topk 8 --moe-shared-expert-intermediate-size 2048 --moe-first-dense-layers 1 --moe-router-score-function sigmoid --no-moe-router-pre-softmax --moe-router-enable-expert-bias --moe-router-topk-scaling-factor 2.5 --moe-aux-loss-coeff 0.0001 --moe-router-load-balancing-type seq_aux_loss $B --micro-batch-size 2 --global-batch-size 2 > $OUT/pdsv3.txt 2>&1; tail -14 $OUT/pdsv3.txt
