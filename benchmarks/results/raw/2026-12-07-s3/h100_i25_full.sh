#!/usr/bin/env bash
# H100 call 3 (no H200 came in eight requests): issue 25's bench on an H100: the server at 1/8/32/64 clients with
# the defaults (--batch-wait-ms 50, kept-alive bench clients), the same at 32/64 without the wait (both --repeats 2),
# then the engine beside HF generate (static cache + torch.compile) at 1/8 with the rows-equal-HF check, and 32/64.
# Run: BUDGET=470 bash benchmarks/results/raw/2026-12-07-s3/h100_i25_full.sh
set -uo pipefail
T0=$(date +%s)
source benchmarks/device_setup.sh
for variant in "default:--clients 1 8 32 64" "wait0:--clients 32 64 --batch-wait-ms 0"; do
  name=${variant%%:*}; flags=${variant#*:}
  echo "== serving $flags $(date +%T) (left $(left)s)"
  [ $(left) -lt 60 ] && break
  timeout $(( $(left) > 145 ? 130 : $(left) - 15 )) python3 benchmarks/serving_speed.py --device cuda --repeats 2 \
    $flags --output $OUT/serving_$name.json > $OUT/serving_$name.log 2>&1
  echo "exit $?"; grep -v "^\[W" $OUT/serving_$name.log | grep -v "^per engine round" | tail -11 | cut -c1-220
done
echo "== engine vs HF generate $(date +%T) (left $(left)s)"
timeout $(( $(left) - 5 )) python3 benchmarks/generation_speed.py --device cuda --batch-sizes 1 8 32 64 --paths step_gemm \
  --hf static --hf-batch-sizes 1 8 --repeats 2 --prefill-len 0 --output $OUT/generation.json > $OUT/generation.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/generation.log | grep -v "inference: GEMM" | tail -14 | cut -c1-260
echo "== end $(date +%T) (left $(left)s)"
