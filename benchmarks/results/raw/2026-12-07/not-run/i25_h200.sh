#!/usr/bin/env bash
# Issue 25's must-show in one H200 call: the engine's decode (the step_gemm path) beside HF generate (static cache
# + torch.compile at batch 1 and 8, with the rows-equal-HF check), then the server through HTTP at 1/8/32/64
# clients against the engine alone (the default front-end, --frontend process, and --batch-wait-ms 50; the clients in
# 8 processes), the same at 32/64 with httptools and uvloop installed (carry .whl-http too), then the PDL probe.
# step_gemm's plan choice logs each GEMM's time with and without PDL ("inference: GEMM ... pdl" in generation.log).
# Run: BUDGET=570 bash benchmarks/results/raw/2026-12-07/not-run/i25_h200.sh
set -uo pipefail
T0=$(date +%s)
source benchmarks/device_setup.sh
echo "== decode GEMM GPU tests (the PDL variant's first run) $(date +%T)"
timeout 90 python3 -m pytest -q -p no:cacheprovider -W ignore tests/gpu/test_decode_graph_gemm.py > $OUT/gpu_gemm.log 2>&1
echo "exit $?"; grep -E "passed|failed|^FAILED" $OUT/gpu_gemm.log | tail -6
echo "== engine vs HF generate $(date +%T) (left $(left)s)"
timeout 270 python3 benchmarks/generation_speed.py --device cuda --batch-sizes 1 8 32 64 --paths step_gemm \
  --hf static --hf-batch-sizes 1 8 --repeats 2 --prefill-len 0 --breakdown --output $OUT/generation.json \
  > $OUT/generation.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/generation.log | grep -v "inference: GEMM" | tail -16 | cut -c1-300
echo "== serving 1 8 32 64 clients $(date +%T) (left $(left)s)"
timeout $(( $(left) > 215 ? 200 : $(left) - 15 )) python3 benchmarks/serving_speed.py --device cuda \
  --clients 1 8 32 64 --repeats 2 --output $OUT/serving.json > $OUT/serving.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/serving.log | grep -v "^per engine round" | tail -14 | cut -c1-300
echo "== serving 32 64 clients with httptools + uvloop (uvicorn's auto choice when installed) $(date +%T) (left $(left)s)"
if [ $(left) -ge 90 ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site-http .whl-http/*.whl; then
  PYTHONPATH=/tmp/site-http:$PYTHONPATH timeout $(( $(left) > 115 ? 100 : $(left) - 15 )) python3 \
    benchmarks/serving_speed.py --device cuda --clients 32 64 --repeats 1 --output $OUT/serving_http.json \
    > $OUT/serving_http.log 2>&1
  echo "exit $?"; grep -v "^\[W" $OUT/serving_http.log | grep -v "^per engine round" | tail -8 | cut -c1-300
fi
echo "== PDL probe $(date +%T) (left $(left)s)"
timeout $(( $(left) - 3 )) python3 benchmarks/decode_pdl_probe.py --output $OUT/pdl_probe.json > $OUT/pdl_probe.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/pdl_probe.log | tail -8 | cut -c1-300
echo "== end $(date +%T) (left $(left)s)"
