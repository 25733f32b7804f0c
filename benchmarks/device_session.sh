#!/usr/bin/env bash
# One GPU-machine call for the inference and checkpoint figures: GPU tests, generation speed (with a profile),
# serving speed, and the 1.72B checkpoint save (size and time). Each part is time-bounded; logs go to $OUT.
# Usage (device tool, .whl carried): bash benchmarks/device_session.sh [parts...]  (default: all of
#   generation tests checkpoint serving, in that order of priority; async_save on request)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
parts=${*:-generation tests checkpoint serving}
for part in $parts; do
  start=$(date +%s)
  case $part in
    tests)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu > "$OUT/gpu_tests.log" 2>&1
      tail -6 "$OUT/gpu_tests.log" ;;
    generation)
      timeout 400 python3 benchmarks/generation_speed.py --device cuda --profile --repeats 2 --output "$OUT/generation.json" \
        > "$OUT/generation.log" 2>&1
      grep -v "^\[W" "$OUT/generation.log" | grep -v "^ *$" | head -150 ;;
    serving)
      timeout 300 python3 benchmarks/serving_speed.py --device cuda --output "$OUT/serving.json" > "$OUT/serving.log" 2>&1
      tail -20 "$OUT/serving.log" ;;
    checkpoint)
      timeout 400 deepspeed --num_gpus 1 benchmarks/checkpoint_size.py --num-layers 24 --hidden-size 2048 \
        --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --pad-vocab-size-to 250880 \
        --micro-batch-size 1 --global-batch-size 1 --bf16 --deepspeed --save /tmp/ckpt_size \
        --output "$OUT/checkpoint.json" > "$OUT/checkpoint.log" 2>&1
      tail -15 "$OUT/checkpoint.log" ;;
    async_save)  # sync vs --async-save blocked time, background write, verify and load (the JSON grows as it goes)
      timeout 290 deepspeed --num_gpus 1 benchmarks/async_save.py --num-layers 24 --hidden-size 2048 \
        --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --pad-vocab-size-to 250880 \
        --micro-batch-size 1 --global-batch-size 1 --bf16 --deepspeed --save /tmp/ckpt_async \
        --output "$OUT/async_save.json" > "$OUT/async_save.log" 2>&1
      grep -v "^\[W" "$OUT/async_save.log" | grep -E "snapshot|background|verified|resumed|checkpoint save|async_save:" ;;
  esac
  echo "== $part: $(( $(date +%s) - start )) s"
done
