#!/usr/bin/env bash
set -uo pipefail
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== gemm epilogue GPU tests $(date +%T)"
timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/gpu/test_gemm_epilogue.py > $OUT/gpu_epi.log 2>&1
echo "exit $?"; tail -25 $OUT/gpu_epi.log
echo "== bench --gemm-epilogues $(date +%T)"
timeout 190 python3 tools/benchmark_training.py --skip-hf --compile-blocks --gemm-epilogues --iters 3 --warmup-iters 1 --profile --profile-top 30 --gaps --origins reduce_kernel,Memset,Memcpy,CatArray --output $OUT/bench_epi.json > $OUT/bench_epi.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/bench_epi.log | sed -n '/^model {/,$p' | head -120
left=$(( 560 - ($(date +%s) - T0) ))
echo "== bench baseline $(date +%T) (left ${left}s)"
timeout $left python3 tools/benchmark_training.py --skip-hf --compile-blocks --iters 3 --warmup-iters 1 --profile --profile-top 30 --output $OUT/bench_base.json > $OUT/bench_base.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/bench_base.log | sed -n '/^model {/,$p' | head -60
echo "== end $(date +%T)"
