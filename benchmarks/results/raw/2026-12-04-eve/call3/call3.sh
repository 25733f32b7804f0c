#!/usr/bin/env bash
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
cd .gpu/int3
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
echo "== serving, two processes $(date +%T)"
timeout 260 python3 benchmarks/serving_speed.py --device cuda --repeats 2 --output $OUT/serving.json > $OUT/serving.log 2>&1
grep -v "^\[W" $OUT/serving.log | tail -22
echo "== gpu tests $(date +%T)"
timeout -s INT -k 10 110 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_inference.py tests/gpu/test_tensor_parallel_inference.py > $OUT/gpu_tests.log 2>&1
tail -3 $OUT/gpu_tests.log
echo "== training, activation checkpointing $(date +%T)"
timeout 170 python3 tools/benchmark_training.py --skip-hf --compile-blocks --checkpoint-activations --iters 3 --warmup-iters 1 --output $OUT/train_ckpt.json > $OUT/train_ckpt.log 2>&1
grep -v "^\[W" $OUT/train_ckpt.log | sed -n '/^model {/,$p' | head -4
echo "== end $(date +%T)"
