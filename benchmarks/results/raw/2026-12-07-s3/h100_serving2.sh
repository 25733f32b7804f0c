#!/usr/bin/env bash
# H100 call 2: the server at 8/32/64 clients with 22228e4's defaults (--batch-wait-ms 50, 3 ms gap; token-id prompts
# checked on the loop; the bench's clients start together), then with --batch-wait-ms 0 at 32/64 on the same machine.
# Run: BUDGET=170 bash benchmarks/results/raw/2026-12-07-s3/h100_serving2.sh
set -uo pipefail
T0=$(date +%s)
source benchmarks/device_setup.sh
for variant in "default:--clients 8 32 64" "wait0:--clients 32 64 --batch-wait-ms 0"; do
  name=${variant%%:*}; flags=${variant#*:}
  echo "== serving $flags $(date +%T) (left $(left)s)"
  [ $(left) -lt 50 ] && break
  timeout $(( $(left) > 95 ? 80 : $(left) - 10 )) python3 benchmarks/serving_speed.py --device cuda --repeats 1 \
    $flags --output $OUT/serving_$name.json > $OUT/serving_$name.log 2>&1
  echo "exit $?"; grep -v "^\[W" $OUT/serving_$name.log | grep -v "^per engine round" | tail -9 | cut -c1-220
done
echo "== end $(date +%T) (left $(left)s)"
