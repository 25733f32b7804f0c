#!/usr/bin/env bash
# any GPU: GPU inference tests, prefill graphs vs eager (cold/warm per group), serving 1/8/32/64 (server best-of too)
set -uo pipefail
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=/tmp/site/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
export PYTHONPATH=/tmp/site:$PWD
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== GPU inference tests $(date +%T)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_inference.py > $OUT/gpu_inference_tests.log 2>&1
echo "exit $?"; grep -E "^(FAILED|ERROR|E )" $OUT/gpu_inference_tests.log | head -20 | cut -c1-300; tail -2 $OUT/gpu_inference_tests.log
echo "== prefill probe: graphs vs eager $(date +%T) (left $(left)s)"
timeout 150 python3 .gpu/probe_prefill3.py > $OUT/probe_prefill3.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/probe_prefill3.log | grep -v "^ *[0-9]* *[0-9]* *[0-9.]* *[0-9.]*$" | tail -12
grep -v "^\[W" $OUT/probe_prefill3.log | grep -E "^ *(1|8|32|64) +40 " 
echo "== serving 1 8 32 64 clients $(date +%T) (left $(left)s)"
timeout $(( $(left) - 5 )) python3 benchmarks/serving_speed.py --device cuda --repeats 2 --output $OUT/serving.json > $OUT/serving.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/serving.log | grep -v "^per engine round" | tail -16 | cut -c1-300
echo "== end $(date +%T) (left $(left)s)"
