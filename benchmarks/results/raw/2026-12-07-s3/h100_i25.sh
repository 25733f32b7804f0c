#!/usr/bin/env bash
# H100 call (no H200 came): the decode GEMM GPU tests (the PDL variant's and the restored attention launches' first
# GPU run), the server's batch-wait A/B at 8/32/64 clients (default 10 ms / 2 ms gap; 20 ms / 5 ms gap; none),
# then the PDL probe with what is left. Run: BUDGET=360 bash benchmarks/results/raw/2026-12-07-s3/h100_i25.sh
set -uo pipefail
T0=$(date +%s)
source benchmarks/device_setup.sh
echo "== decode GEMM GPU tests $(date +%T)"
timeout 150 python3 -m pytest -q -p no:cacheprovider -W ignore tests/gpu/test_decode_graph_gemm.py > $OUT/gpu_gemm.log 2>&1
echo "exit $?"; grep -E "passed|failed|^FAILED|Error" $OUT/gpu_gemm.log | tail -8 | cut -c1-300
for variant in "default:" "gap5:--batch-wait-ms 20 --batch-gap-ms 5" "wait0:--batch-wait-ms 0"; do
  name=${variant%%:*}; flags=${variant#*:}
  echo "== serving 8 32 64 clients $flags $(date +%T) (left $(left)s)"
  [ $(left) -lt 60 ] && break
  timeout $(( $(left) > 105 ? 90 : $(left) - 15 )) python3 benchmarks/serving_speed.py --device cuda \
    --clients 8 32 64 --repeats 1 $flags --output $OUT/serving_$name.json > $OUT/serving_$name.log 2>&1
  echo "exit $?"; grep -v "^\[W" $OUT/serving_$name.log | grep -v "^per engine round" | tail -9 | cut -c1-300
done
echo "== PDL probe $(date +%T) (left $(left)s)"
timeout $(( $(left) - 3 )) python3 benchmarks/decode_pdl_probe.py --output $OUT/pdl_probe.json > $OUT/pdl_probe.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/pdl_probe.log | tail -8 | cut -c1-300
echo "== end $(date +%T) (left $(left)s)"
