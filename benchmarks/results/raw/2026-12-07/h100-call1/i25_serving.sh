#!/usr/bin/env bash
# Any GPU (an H200 for issue 25's figures): the decode GPU tests that never ran on the final code (the graph-dict
# split of 2c99bc8 and the review refactor c8bb37c), then the server with its HTTP front-end on a thread (default)
# and in a process of its own (--frontend process, remote.py), same machine, same run, against the engine alone;
# then benchmarks/decode_l2_prefetch.py (a side stream streaming the next weights into L2) with what is left.
# Run: BUDGET=570 bash benchmarks/results/raw/2026-12-07/not-run/i25_serving.sh
set -uo pipefail
T0=$(date +%s)
source benchmarks/device_setup.sh
echo "== decode GPU tests $(date +%T)"
timeout 130 python3 -m pytest -q -p no:cacheprovider -W ignore tests/gpu/test_decode_graph_gemm.py \
  tests/gpu/test_inference.py > $OUT/gpu_decode.log 2>&1
echo "exit $?"; grep -E "passed|failed|^FAILED" $OUT/gpu_decode.log | tail -8
for frontend in process thread; do
  echo "== serving, --frontend $frontend $(date +%T) (left $(left)s)"
  timeout $(( $(left) / 2 > 180 ? 180 : $(left) - 5 )) python3 benchmarks/serving_speed.py --device cuda \
    --clients 8 32 64 --repeats 2 --frontend $frontend --output $OUT/serving_$frontend.json > $OUT/serving_$frontend.log 2>&1
  echo "exit $?"; grep -v "^\[W" $OUT/serving_$frontend.log | grep -v "^per engine round" | tail -12 | cut -c1-300
done
echo "== L2 prefetch probe $(date +%T) (left $(left)s)"
timeout $(( $(left) - 5 )) python3 benchmarks/decode_l2_prefetch.py --output $OUT/l2_prefetch.json > $OUT/l2_prefetch.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/l2_prefetch.log | grep -v "inference: GEMM" | tail -40 | cut -c1-200
echo "== end $(date +%T) (left $(left)s)"
