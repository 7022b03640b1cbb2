#!/bin/bash
# The GPU measurements of benchmarks/RESULTS.md, a few device calls' worth: attention
# correctness per implementation, device traces of the train step, and electra-jax's step
# against Hugging Face's PyTorch step (bf16 autocast, SDPA) in the same process, for
# electra_small at seq 128 and electra_base at seq 512. Expects prepared corpora from
#   python -m electra_jax.main --mode=prepare_data --config=configs/electra_small.py \
#       --config.data.max_seq_len=L --config.data.prepared_dir=.bench_data/sL --config.data.max_documents=6000
# for L in 128 and 512, and writes JSON results into $OUT (or ./gpu_results).
#
# Usage: bash benchmarks/gpu_suite.sh MODE...   with MODE in
#   check    versions, attention implementations against the xla reference
#   profile  device traces (top kernels) of the small and base steps
#   small    electra_small at seq 128, batch 128, against the PyTorch peer
#   small_big  electra_small at a batch of 1024 packed rows, 10 steps per call
#   small_dropout  electra_small with the paper's attention dropout, against the peer
#   base     electra_base at seq 512, batch 32, against the PyTorch peer
#   base_packed  the same with packed rows, cudnn and xla attention
#   memory   the largest batch that fits, per official size and sequence length
#   layer    one encoder layer (small and base sizes, bf16): rows_dot_general against flax's
#            N-D dense, and PyTorch's ElectraLayer under autocast
# Compiles take about a minute each on an H100/H200; the persistent compilation cache
# (/tmp/jax_cache) lets a later run of the same step skip it.
set -u
OUT=${OUT:-gpu_results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false  # torch shares the GPU
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
summary="$OUT/summary.txt"

tp() {  # name, timeout, then pretrain_throughput flags
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout "$limit" python3 benchmarks/pretrain_throughput.py --steps=20 --windows=3 --warmup=3 "$@" \
      > "$OUT/$name.json" 2> "$OUT/$name.err" || { echo "FAILED $name"; tail -5 "$OUT/$name.err"; }
  python3 - "$OUT/$name.json" "$name" >> "$summary" <<'PY'
import json, sys
try:
  r = json.load(open(sys.argv[1]))
except Exception as e:
  sys.exit(f"{sys.argv[2]}: no result ({e})")
line = (f"{sys.argv[2]}: ours {r['step_ms']} ms {r['tokens_per_sec']:.0f} tok/s "
        f"mfu {r['mfu']} compile {r['compile_seconds']} s")
for k in ("huggingface", "huggingface_gathered"):
  if k in r:
    line += f" | {k} {r[k]['step_ms']} ms x{r[k]['ratio_ours_over_theirs']}"
print(line)
PY
  tail -1 "$summary"
}

prof() {  # name, timeout, then step_profile flags
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout "$limit" python3 benchmarks/step_profile.py --parts=false --steps=10 --top=30 \
      --trace="/tmp/trace_$name" "$@" > "$OUT/$name.json" 2> "$OUT/$name.err" \
      || { echo "FAILED $name"; tail -5 "$OUT/$name.err"; }
  python3 - "$OUT/$name.json" "$name" >> "$summary" <<'PY'
import json, sys
try:
  r = json.load(open(sys.argv[1]))
except Exception as e:
  sys.exit(f"{sys.argv[2]}: no result ({e})")
print(f"{sys.argv[2]}: whole step {r['ms_per_call']['whole train step']} ms")
for name, ms, calls in r["top_kernels_ms_per_step"][:16]:
  print(f"   {ms:9.3f} ms  x{calls:<6g} {name[:80]}")
PY
}

data_small="--config.data.source=prepared --config.data.prepared_dir=.bench_data/s128"
data_base="--config.data.source=prepared --config.data.prepared_dir=.bench_data/s512 --config.data.max_seq_len=512"
small="--config=configs/electra_small.py $data_small --config.train.dtype=bfloat16"
base="--config=configs/electra_base.py $data_base --config.train.dtype=bfloat16"
fast="--config.model.attention_impl=cudnn --config.model.attention_dropout_rate=0.0"

for what in "${@:-check}"; do
  case $what in
    check)
      nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
      python3 -c "import jax, flax, optax, torch, transformers; print(jax.__version__, flax.__version__, optax.__version__, torch.__version__, transformers.__version__, jax.devices())"
      timeout 200 python3 benchmarks/attention_check.py --batch=8 --seq=128 > "$OUT/attention_small.json" 2>"$OUT/attention_small.err" || tail -5 "$OUT/attention_small.err"
      timeout 200 python3 benchmarks/attention_check.py --batch=4 --seq=512 --hidden=768 --heads=12 > "$OUT/attention_base.json" 2>"$OUT/attention_base.err" || tail -5 "$OUT/attention_base.err"
      python3 -c "
import json,sys
for f in sys.argv[1:]:
  for r in json.load(open(f))['rows']: print(f.split('/')[-1], r)" "$OUT"/attention_*.json >> "$summary"
      ;;
    profile)
      prof prof_small_b128 200 $small --config.train.batch_size=128 $fast
      prof prof_base_b32 240 $base --config.train.batch_size=32 $fast
      ;;
    small)
      tp small_b128_cudnn 200 $small --config.train.batch_size=128 $fast --vs-huggingface --hf-gathered
      ;;
    small_big)  # a batch that fills the GPU, packed rows, 10 steps per call
      tp small_b1024_packed_k10 240 $small --config.train.batch_size=1024 $fast --config.data.pack_rows=True --config.train.steps_per_call=10
      ;;
    small_dropout)  # the paper's attention dropout (explicit attention path) on both sides
      tp small_b128_xla_attndrop 240 $small --config.train.batch_size=128 --vs-huggingface --hf-gathered
      ;;
    base)
      tp base_b32_cudnn 300 $base --config.train.batch_size=32 $fast --vs-huggingface --hf-gathered
      ;;
    base_packed)  # cuDNN reads packed rows' segment mask as a bias (a slower kernel): against xla
      tp base_b32_packed 240 $base --config.train.batch_size=32 $fast --config.data.pack_rows=True
      tp base_b32_packed_xla 240 $base --config.train.batch_size=32 --config.model.attention_dropout_rate=0.0 --config.data.pack_rows=True
      ;;
    memory)
      # bfloat16, as the GPU recipes train; the table is markdown for RESULTS.md
      timeout 560 python3 benchmarks/max_batch.py --dtype=bfloat16 --step=8 > "$OUT/max_batch.md" 2> "$OUT/max_batch.err" \
        || tail -5 "$OUT/max_batch.err"
      cat "$OUT/max_batch.md"
      ;;
    layer)
      for sizes in "--hidden=256 --heads=4 --ffn=1024 --batch=128 --seq=128" \
                   "--hidden=768 --heads=12 --ffn=3072 --batch=32 --seq=512"; do
        # shellcheck disable=SC2086
        timeout 300 python3 benchmarks/encoder_layer.py $sizes --dtype=bfloat16 --flax_dense --torch --runs=50 \
          2>> "$OUT/layer.err" | tee -a "$OUT/layer.txt" || tail -5 "$OUT/layer.err"
      done
      ;;
    *) echo "unknown mode $what"; exit 2 ;;
  esac
done
echo "===== summary"
cat "$summary"
