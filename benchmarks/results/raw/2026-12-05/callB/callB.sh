#!/usr/bin/env bash
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
echo "== --checkpoint-activations $(date +%T)"
timeout 150 python3 tools/benchmark_training.py --skip-hf --compile-blocks --checkpoint-activations --iters 2 --warmup-iters 1 --output $OUT/train_ckpt.json > $OUT/train_ckpt.log 2>&1
grep -v "^\[W" $OUT/train_ckpt.log | sed -n '/^model {/,$p' | head -4
echo "== pytest tests/gpu $(date +%T)"
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -25 | tee $OUT/gpu_tests.log
echo "== end $(date +%T)"
