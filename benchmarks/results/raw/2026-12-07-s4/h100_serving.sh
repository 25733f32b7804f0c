#!/usr/bin/env bash
# H100 call (no H200 came): the server at a078695 (the front-end's small messages sent from the loop, a burst's wait
# spanning gaps up to 10 ms) at 1/8/32/64 clients with the defaults, then 32/64 with --burst-gap-ms 3 (a078695's
# inline sends, the old 3 ms gap within a burst) on the same machine.
# Run: BUDGET=260 bash benchmarks/results/raw/2026-12-07-s4/h100_serving.sh
set -uo pipefail
T0=$(date +%s)
source benchmarks/device_setup.sh
for variant in "default:--clients 1 8 32 64 --repeats 2" "burst3:--clients 32 64 --repeats 2 --burst-gap-ms 3"; do
  name=${variant%%:*}; flags=${variant#*:}
  echo "== serving $flags $(date +%T) (left $(left)s)"
  [ $(left) -lt 60 ] && break
  timeout $(( $(left) > 145 ? 140 : $(left) - 10 )) python3 benchmarks/serving_speed.py --device cuda \
    $flags --output $OUT/serving_$name.json > $OUT/serving_$name.log 2>&1
  echo "exit $?"; grep -v "^\[W" $OUT/serving_$name.log | grep -v "^per engine round" | tail -13 | cut -c1-230
done
echo "== end $(date +%T) (left $(left)s)"
