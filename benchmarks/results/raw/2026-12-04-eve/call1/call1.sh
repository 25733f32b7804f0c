#!/usr/bin/env bash
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
cd $PWD
echo "== training gaps $(date +%T)"
timeout 260 python3 tools/benchmark_training.py --skip-hf --compile-blocks --iters 2 --warmup-iters 1 --profile --profile-top 45 --gaps --output $OUT/train_gaps.json > $OUT/train_gaps.log 2>&1
grep -v "^\[W" $OUT/train_gaps.log | sed -n '/^model {/,$p' | head -120
echo "== gpu tests $(date +%T)"
timeout -s INT -k 10 170 python3 -m pytest -q -p no:cacheprovider tests/gpu -x -q > $OUT/gpu_tests.log 2>&1
tail -8 $OUT/gpu_tests.log
echo "== serving $(date +%T)"
timeout 130 python3 benchmarks/serving_speed.py --device cuda --clients 8 32 --output $OUT/serving.json > $OUT/serving.log 2>&1
grep -v "^\[W" $OUT/serving.log | tail -30
echo "== end $(date +%T)"
