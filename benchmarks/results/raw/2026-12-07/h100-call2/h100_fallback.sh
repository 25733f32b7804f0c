#!/usr/bin/env bash
# Any GPU (no H200 came this session): the DGELU epilogue's GPU tests on the final code, the PDL probe
# (benchmarks/decode_pdl_probe.py), today's engine decode at batch 1 and 64 with the breakdown, then ours alone
# in training with the final epilogue code and the step profile.
# Run: BUDGET=480 bash benchmarks/results/raw/2026-12-07/not-run/h100_fallback.sh
set -uo pipefail
T0=$(date +%s)
source benchmarks/device_setup.sh
echo "== DGELU epilogue GPU tests $(date +%T)"
timeout 90 python3 -m pytest -q -p no:cacheprovider -W ignore tests/gpu/test_gemm_epilogue.py > $OUT/gpu_epilogue.log 2>&1
echo "exit $?"; grep -E "passed|failed|^FAILED" $OUT/gpu_epilogue.log | tail -6
echo "== PDL probe $(date +%T) (left $(left)s)"
timeout 90 python3 benchmarks/decode_pdl_probe.py --output $OUT/pdl_probe.json > $OUT/pdl_probe.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/pdl_probe.log | tail -8 | cut -c1-300
echo "== engine decode, batch 1 and 64 $(date +%T) (left $(left)s)"
timeout 110 python3 benchmarks/generation_speed.py --device cuda --batch-sizes 1 64 --paths step_gemm \
  --hf none --repeats 2 --prefill-len 0 --breakdown --output $OUT/generation.json > $OUT/generation.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/generation.log | grep -v "inference: GEMM" | tail -10 | cut -c1-300
echo "== training, ours --compile-blocks --profile $(date +%T) (left $(left)s)"
timeout $(( $(left) - 3 )) python3 tools/benchmark_training.py --skip-hf --compile-blocks --iters 2 --warmup-iters 1 \
  --profile --output $OUT/train.json > $OUT/train.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/train.log | grep -E "^side |^ours|profile of one step|gemm|attention|elementwise|idle" | head -14 | cut -c1-300
echo "== end $(date +%T) (left $(left)s)"
