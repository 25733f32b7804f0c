#!/usr/bin/env bash
# One GPU-machine call for issue 25's fused decode step: its GPU tests, then generation speed of our decode paths
# (unfused = the engine before, fused = decode.py eager, compiled = torch.compile default) against HF generate
# (static cache + compile at batch 1 and 8, default generate at 32 and 64) at batch 1/8/32/64 on the 1.72B model
# in bf16, then (part "autotune", its own call) the max-autotune-no-cudagraphs path at batch 1 and 64 (with unfused).
# Each part is time-bounded; logs and JSON go to $OUT. Usage, from the repository root after DeepSpeed's install:
#   bash benchmarks/decode_session.sh [parts...]    (default: generation tests; autotune is a third, separate call)
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor_cache}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for part in ${*:-generation tests}; do
  start=$(date +%s)
  case $part in
    tests)
      timeout 150 python3 -m pytest -q -rA -p no:cacheprovider -s tests/gpu/test_fused_decode.py tests/gpu/test_inference.py \
        > "$OUT/decode_gpu_tests.log" 2>&1
      grep -E "bf16 vs HF|passed|failed|Error" "$OUT/decode_gpu_tests.log" | tail -15 ;;
    generation)
      timeout 360 python3 benchmarks/generation_speed.py --device cuda --batch-sizes 1 8 32 64 \
        --paths unfused fused compiled --hf static --repeats 2 --hf-repeats 1 --prefill-len 0 --output "$OUT/decode_generation.json" \
        > "$OUT/decode_generation.log" 2>&1
      grep -v "^\[W" "$OUT/decode_generation.log" | grep -v "^ *$" | tail -40 ;;
    autotune)
      timeout 300 python3 benchmarks/generation_speed.py --device cuda --batch-sizes 1 64 --paths unfused autotune --hf none \
        --repeats 2 --prefill-len 0 --output "$OUT/decode_autotune.json" > "$OUT/decode_autotune.log" 2>&1
      grep -v "^\[W" "$OUT/decode_autotune.log" | grep -v "^ *$" | tail -20 ;;
  esac
  echo "== $part: $(( $(date +%s) - start )) s"
done
