#!/usr/bin/env bash
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== build $(date +%T)"
python3 - <<'PY' 2>&1 | tee $OUT/build.log | tail -30
import logging, time
logging.basicConfig(level=logging.DEBUG)
t = time.time()
from megatron.fused_kernels import load_fused_kernels
m = load_fused_kernels(abort_on_unmet_constraints=True)
print("built", round(time.time() - t, 1), "s", m.gemm_epilogue_fallbacks())
PY
[ "${PIPESTATUS[0]}" = 0 ] || { echo BUILD FAILED; exit 2; }
echo "== gemm epilogue GPU tests $(date +%T)"
timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests/gpu/test_gemm_epilogue.py 2>&1 | tail -25 | tee $OUT/gpu_epilogue.log
echo "== op bench $(date +%T)"
timeout 60 python3 benchmarks/gemm_epilogues.py --output $OUT/ops.json 2>&1 | grep -v "^\[W" | tee $OUT/ops.log
echo "== train B: --compile-blocks --gemm-epilogues $(date +%T)"
timeout 170 python3 tools/benchmark_training.py --skip-hf --compile-blocks --gemm-epilogues --profile --profile-top 40 --output $OUT/train_epi.json > $OUT/train_epi.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/train_epi.log | sed -n '/^model {/,$p' | head -40
echo "== train A: --compile-blocks $(date +%T)"
timeout 150 python3 tools/benchmark_training.py --skip-hf --compile-blocks --profile --profile-top 40 --output $OUT/train_base.json > $OUT/train_base.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/train_base.log | sed -n '/^model {/,$p' | head -30
echo "== end $(date +%T)"
