#!/usr/bin/env bash
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
cd .gpu/int3
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
echo "== training: one-sync unfused step + grad accumulation fusion $(date +%T)"
timeout 230 python3 tools/benchmark_training.py --skip-hf --compile-blocks --iters 3 --warmup-iters 1 --profile --profile-top 16 --gaps --output $OUT/train_gaf.json > $OUT/train_gaf.log 2>&1
grep -v "^\[W" $OUT/train_gaf.log | sed -n '/^model {/,$p' | head -60
echo "== without the fusion $(date +%T)"
timeout 150 python3 tools/benchmark_training.py --skip-hf --compile-blocks --iters 3 --warmup-iters 1 --no-gradient-accumulation-fusion --output $OUT/train_nogaf.json > $OUT/train_nogaf.log 2>&1
grep -v "^\[W" $OUT/train_nogaf.log | sed -n '/^model {/,$p' | head -4
echo "== gpu test $(date +%T)"
timeout -s INT -k 10 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_grad_accumulation.py > $OUT/gpu_gaf.log 2>&1
tail -4 $OUT/gpu_gaf.log
echo "== end $(date +%T)"
