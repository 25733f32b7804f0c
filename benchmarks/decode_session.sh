#!/usr/bin/env bash
# One GPU-machine call for issue 25's decode step (round 2), at most ~7 minutes: the decode GPU tests, then the A/B
# of our decode paths at batch 1/64/8/32 on the 1.72B model in bf16 (unfused = the engine before issue 25,
# compiled = round 1's fused step under torch.compile, step = + the whole step in the CUDA graph, step_gemm = + the
# skinny Triton GEMMs where timed faster) against HF generate (static cache + compile at batch 1 and 8, default
# generate at 32 and 64), rows equal to HF at 1 and 8, and the profiles of step_gemm at batch 1 and 64.
# Each part is time-bounded (160 + 255 s; the tests get SIGINT, so pytest still prints its summary); logs and JSON
# go to $OUT (the JSON is rewritten as each path and batch size completes: a part cut short keeps what it measured).
# Optional parts: autotune (max-autotune-no-cudagraphs at 1 and 64), gemm (the GEMMs without the whole-step graph),
# sweep (benchmarks/decode_gemm_sweep.py), breakdown (generation_speed.py --breakdown of step and step_gemm), round2
# (a shorter tests + sweep + breakdown).
# Usage, from the repository root after DeepSpeed's install:
#   bash benchmarks/decode_session.sh [parts...]    (default: tests ab)
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor_cache}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for part in ${*:-tests ab}; do
  start=$(date +%s)
  case $part in
    tests)
      timeout -s INT -k 15 160 python3 -m pytest -q -rA -p no:cacheprovider -s tests/gpu/test_decode_graph_gemm.py \
        tests/gpu/test_fused_decode.py > "$OUT/decode_gpu_tests.log" 2>&1
      grep -E "bf16 vs HF|passed|failed|Error" "$OUT/decode_gpu_tests.log" | tail -25 ;;
    ab)
      timeout 255 python3 benchmarks/generation_speed.py --device cuda --batch-sizes 1 64 8 32 \
        --paths unfused compiled step step_gemm --hf static --repeats 2 --hf-repeats 1 --prefill-len 0 \
        --profile --profile-paths step_gemm --profile-batches 1 64 --output "$OUT/decode_ab.json" \
        > "$OUT/decode_ab.log" 2>&1
      grep -v "^\[W" "$OUT/decode_ab.log" | grep -v "^ *$" | tail -120 ;;
    gemm)
      timeout 200 python3 benchmarks/generation_speed.py --device cuda --batch-sizes 1 64 --paths compiled gemm \
        --hf none --repeats 2 --prefill-len 0 --output "$OUT/decode_gemm.json" > "$OUT/decode_gemm.log" 2>&1
      grep -v "^\[W" "$OUT/decode_gemm.log" | grep -v "^ *$" | tail -20 ;;
    sweep)  # every skinny-GEMM plan and torch at the decode shapes, the decode attention's launches
      timeout 150 python3 benchmarks/decode_gemm_sweep.py --output "$OUT/decode_gemm_sweep.json" \
        > "$OUT/decode_gemm_sweep.log" 2>&1
      grep -E "fastest|engine's|defaults|^rows|Error" "$OUT/decode_gemm_sweep.log" | tail -60 ;;
    breakdown)  # generate()'s wall time = prefill + decode steps + host time, at batch 1 and 64
      timeout 150 python3 benchmarks/generation_speed.py --device cuda --batch-sizes 1 64 --paths step step_gemm \
        --hf none --repeats 2 --prefill-len 0 --breakdown --output "$OUT/decode_breakdown.json" \
        > "$OUT/decode_breakdown.log" 2>&1
      grep -v "^\[W" "$OUT/decode_breakdown.log" | grep -E "^ +(1|64) |^-- |Error" | tail -20 ;;
    round2)  # ~3 minutes: the GPU tests above, the attention launches and the GEMMs with a LayerNorm prologue
      # (1 and 8 rows), generate()'s breakdown of step_gemm at batch 1 and 64
      timeout -s INT -k 15 100 python3 -m pytest -q -rA -p no:cacheprovider tests/gpu/test_decode_graph_gemm.py \
        tests/gpu/test_fused_decode.py::test_triton_attention_equals_torch > "$OUT/decode_gpu_tests.log" 2>&1
      grep -E "passed|failed|Error" "$OUT/decode_gpu_tests.log" | tail -8
      timeout 100 python3 benchmarks/decode_gemm_sweep.py --shapes qkv "h->4h" "LM head" --rows 1 8 \
        --output "$OUT/decode_gemm_sweep.json" > "$OUT/decode_gemm_sweep.log" 2>&1
      grep -E "fastest|defaults|^rows|failed|Error" "$OUT/decode_gemm_sweep.log" | tail -40
      timeout 130 python3 benchmarks/generation_speed.py --device cuda --batch-sizes 1 64 --paths step_gemm \
        --hf none --repeats 2 --prefill-len 0 --breakdown --output "$OUT/decode_breakdown.json" \
        > "$OUT/decode_breakdown.log" 2>&1
      grep -v "^\[W" "$OUT/decode_breakdown.log" | grep -E "^ +(1|64) |^-- |Error" | tail -12 ;;
    autotune)
      timeout 300 python3 benchmarks/generation_speed.py --device cuda --batch-sizes 1 64 --paths unfused autotune --hf none \
        --repeats 2 --prefill-len 0 --output "$OUT/decode_autotune.json" > "$OUT/decode_autotune.log" 2>&1
      grep -v "^\[W" "$OUT/decode_autotune.log" | grep -v "^ *$" | tail -20 ;;
  esac
  echo "== $part: $(( $(date +%s) - start )) s"
done
