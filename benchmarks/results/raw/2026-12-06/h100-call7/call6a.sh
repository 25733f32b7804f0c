#!/usr/bin/env bash
# any GPU: serving diagnosis (main, per-round columns; GIL switch interval 5 ms vs 0.5 ms) + prefill cold/warm probe
set -uo pipefail
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=/tmp/site/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
export PYTHONPATH=/tmp/site:$PWD
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== prefill probe $(date +%T)"
timeout 110 python3 .gpu/probe_prefill.py > $OUT/probe_prefill.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/probe_prefill.log | head -24
echo "== main: GPU test of the round counters $(date +%T)"
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_inference.py -k overlapped > $OUT/main_gpu_tests.log 2>&1
echo "exit $?"; tail -2 $OUT/main_gpu_tests.log
for sw in 0.005 0.0005; do
  echo "== serving 8 32 clients, switch interval $sw $(date +%T) (left $(left)s)"
  timeout $(( $(left) < 170 ? $(left) - 3 : 170 )) python3 benchmarks/serving_speed.py --device cuda --clients 8 32 --repeats 2 --switch-interval $sw --output $OUT/serving_$sw.json > $OUT/serving_$sw.log 2>&1
  echo "exit $?"; grep -v "^\[W" $OUT/serving_$sw.log | grep -v "^per engine round" | tail -8 | cut -c1-300
done
echo "== end $(date +%T)"
