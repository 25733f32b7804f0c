#!/usr/bin/env bash
# whichever card comes: an H200 runs issue 26's call (call8.sh), an H100 the prefill-graph serving call (call10.sh)
# and the server at a 1 ms GIL switch interval
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then exec bash .gpu/call8.sh; fi
T0=$(date +%s)
BUDGET=$(( ${BUDGET:-500} - 70 )) bash .gpu/call10.sh
export PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
echo "== serving 32 64 clients, switch interval 0.001 $(date +%T)"
timeout 65 python3 benchmarks/serving_speed.py --device cuda --clients 32 64 --repeats 2 --switch-interval 0.001 --output $OUT/serving_sw001.json > $OUT/serving_sw001.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/serving_sw001.log | grep -v "^per engine round" | tail -8 | cut -c1-300
echo "== end $(date +%T)"
