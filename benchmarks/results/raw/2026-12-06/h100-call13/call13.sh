#!/usr/bin/env bash
# an H200: issue 26's must-show (call8.sh, as far as the budget goes); an H100: the whole GPU test suite
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then exec bash .gpu/call8.sh; fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=/tmp/site/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== tests/gpu $(date +%T)"
timeout $(( ${BUDGET:-300} - 20 )) python3 -m pytest -q -p no:cacheprovider tests/gpu --durations=15 > $OUT/gpu_tests.log 2>&1
echo "exit $?"; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log | head -20 | cut -c1-300; tail -20 $OUT/gpu_tests.log | cut -c1-200
echo "== end $(date +%T)"
