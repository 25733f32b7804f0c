#!/usr/bin/env bash
# any GPU: prefill cold/warm A/B (cuDNN SDPA vs plan-free), serving 8/32/64 after the fix, GPU inference tests;
# then, on an H200 with time left, issue 26's bench (call8's first part)
set -uo pipefail
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=/tmp/site/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
export PYTHONPATH=/tmp/site:$PWD
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== prefill probe A/B $(date +%T)"
timeout 120 python3 .gpu/probe_prefill2.py > $OUT/probe_prefill2.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/probe_prefill2.log | tail -36
echo "== serving 8 32 64 clients $(date +%T) (left $(left)s)"
timeout 200 python3 benchmarks/serving_speed.py --device cuda --clients 8 32 64 --repeats 2 --output $OUT/serving.json > $OUT/serving.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/serving.log | grep -v "^per engine round" | tail -12 | cut -c1-300
echo "== GPU inference tests $(date +%T) (left $(left)s)"
timeout $(( $(left) < 150 ? $(left) - 3 : 150 )) python3 -m pytest -q -p no:cacheprovider tests/gpu/test_inference.py > $OUT/gpu_inference_tests.log 2>&1
echo "exit $?"; tail -4 $OUT/gpu_inference_tests.log
echo "== end $(date +%T) (left $(left)s)"
