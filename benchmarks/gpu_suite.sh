#!/bin/bash
# The GPU measurements of benchmarks/RESULTS.md in one command (one device lease): attention
# correctness per implementation, then electra-jax's train step against Hugging Face's PyTorch
# step (bf16 autocast, SDPA) in the same process, for electra_small at seq 128 and electra_base
# at seq 512. Expects prepared corpora from
#   python -m electra_jax.main --mode=prepare_data --config=configs/electra_small.py \
#       --config.data.max_seq_len=L --config.data.prepared_dir=.bench_data/sL --config.data.max_documents=6000
# for L in 128 and 512, and writes JSON results into $OUT (or ./gpu_results).
# Usage: bash benchmarks/gpu_suite.sh [check|small|base|all]. Compiles take about a minute each
# on an H100 (70 s for electra_base): "small" or "base" alone fits one 10-minute device call.
set -u
OUT=${OUT:-gpu_results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false  # torch shares the GPU
what=${1:-all}
tp() {  # name, then pretrain_throughput flags
  local name=$1; shift
  echo "=== $name"
  timeout 420 python3 benchmarks/pretrain_throughput.py --steps=20 --windows=3 --warmup=3 "$@" \
      > "$OUT/$name.json" 2> "$OUT/$name.err" || { echo "FAILED $name"; tail -5 "$OUT/$name.err"; }
  python3 - "$OUT/$name.json" <<'PY'
import json, sys
try:
  r = json.load(open(sys.argv[1]))
except Exception as e:
  sys.exit(f"no result: {e}")
line = f"ours {r['step_ms']} ms {r['tokens_per_sec']} tok/s mfu {r['mfu']}"
for k in ("huggingface", "huggingface_gathered"):
  if k in r:
    line += f" | {k} {r[k]['step_ms']} ms ratio {r[k]['ratio_ours_over_theirs']}"
print(line)
PY
}
small="--config=configs/electra_small.py --config.data.source=prepared --config.data.prepared_dir=.bench_data/s128 --config.train.dtype=bfloat16"
base="--config=configs/electra_base.py --config.data.source=prepared --config.data.prepared_dir=.bench_data/s512 --config.data.max_seq_len=512 --config.train.dtype=bfloat16"
if [[ $what == check || $what == all ]]; then
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import jax, flax, optax, torch, transformers; print(jax.__version__, flax.__version__, optax.__version__, torch.__version__, transformers.__version__, jax.devices())"
  timeout 200 python3 benchmarks/attention_check.py --batch=8 --seq=128 > "$OUT/attention_small.json" 2>"$OUT/attention_small.err" || tail -5 "$OUT/attention_small.err"
  timeout 200 python3 benchmarks/attention_check.py --batch=4 --seq=512 --hidden=768 --heads=12 > "$OUT/attention_base.json" 2>"$OUT/attention_base.err" || tail -5 "$OUT/attention_base.err"
  python3 -c "
import json,sys
for f in sys.argv[1:]:
  for r in json.load(open(f))['rows']: print(f.split('/')[-1], r)" "$OUT"/attention_*.json
fi
if [[ $what == small || $what == all ]]; then
  tp small_b128_xla_attndrop $small --config.train.batch_size=128 --vs-huggingface --hf-gathered
  tp small_b128_cudnn $small --config.train.batch_size=128 --config.model.attention_impl=cudnn --config.model.attention_dropout_rate=0.0 --vs-huggingface --hf-gathered
  tp small_b512_cudnn_k10 $small --config.train.batch_size=512 --config.model.attention_impl=cudnn --config.model.attention_dropout_rate=0.0 --config.train.steps_per_call=10 --config.data.pack_rows=True
fi
if [[ $what == base || $what == all ]]; then
  tp base_b32_cudnn $base --config.train.batch_size=32 --config.model.attention_impl=cudnn --config.model.attention_dropout_rate=0.0 --vs-huggingface --hf-gathered
  tp base_b32_xla_attndrop $base --config.train.batch_size=32 --vs-huggingface --hf-gathered
fi
