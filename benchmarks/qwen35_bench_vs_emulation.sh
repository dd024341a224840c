# The Qwen3.5-9b shape's row (h175 of benchmarks/measured.jsonl: 0.270 s a step on an H100) through `meshtron bench`
# and through emulation (a world of one), 3 warm-up and 5 timed steps each, on this GPU; emulation once with the
# optimizer's state made before the first forward (as `meshtron emulate` did until 2026-12-07, when it measured
# 0.344-0.391 s a step on an H100, commit 17b095b) and once as it runs now. Each prints its timed steps.
#   OUT=/tmp/out bash benchmarks/qwen35_bench_vs_emulation.sh   (on the GPU machine)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
printf 'base: {bf16: true, seq_length: 4096}\nrows:\n  - {model: qwen3.5-9b, num_layers: 8, micro_batch_size: 1, global_batch_size: 1, layer_pattern: "gdn+dense*3,gated_attn+dense,gdn+dense*3,gated_attn+dense"}\n' > /tmp/qwen35.yaml
timeout ${BENCH_TIMEOUT:-100} python3 -m meshtron bench --matrix /tmp/qwen35.yaml --warmup 3 --steps 5 --no-split \
  --out "$OUT/bench_h175.jsonl" > "$OUT/bench_h175.log" 2>&1
echo "bench rc=$?"
python3 - "$OUT/bench_h175.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print("bench", round(r["step_s"], 4), [round(x, 3) for x in r.get("step_times_s", [])], "peak", round(r["peak_mem_gib"], 2),
          "reserved", round(r["peak_reserved_gib"], 2), "allocation retries", r.get("alloc_retries"))
PY
argv="$(python3 -c "import json;[print(r['argv']) for r in map(json.loads,open('benchmarks/measured.jsonl')) if r['id']=='h175']")"
for hold in 1 0; do
  HOLD=$hold timeout ${EMULATE_TIMEOUT:-100} python3 - "$argv" <<'PY' 2>&1 | grep "^emulate"
import os, shlex, sys

import meshtron.bench as bench
import meshtron.emulation.runner as runner

measure = bench._measure
bench._measure = lambda *a, **k: measure(*a[:6], False, *a[7:], **k)  # no split passes: the steps only
if os.environ["HOLD"] == "1":  # as emulation did until 2026-12-07: the state made before the first forward
    runner.hold_optimizer_state = lambda trainer: trainer.optimizer.ensure_state()
em = runner.emulate_rank(shlex.split(sys.argv[1]), 1, 0, warmup=3, steps=5, split_repeats=1)
print("emulate, state made first" if os.environ["HOLD"] == "1" else "emulate", round(em.step_s, 4),
      [round(x, 3) for x in em.step_times_s], "peak", round(em.peak_mem_gib or 0, 2), "reserved",
      round(em.peak_reserved_gib or 0, 2), "allocation retries", em.alloc_retries,
      flush=True)
PY
done
