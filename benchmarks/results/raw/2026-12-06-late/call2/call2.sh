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
echo "== op bench $(date +%T)"
timeout 60 python3 benchmarks/gemm_epilogues.py --output $OUT/ops.json 2>&1 | grep -v "^\[W" | tee $OUT/ops.log
echo "== gemm epilogue GPU tests $(date +%T)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gemm_epilogue.py 2>&1 | tail -8 | tee $OUT/gpu_epilogue.log
run() {  # name, flags...
  local name=$1; shift
  echo "== train $name: $* $(date +%T)"
  timeout ${TO:-120} python3 tools/benchmark_training.py --skip-hf --compile-blocks "$@" --output $OUT/train_$name.json > $OUT/train_$name.log 2>&1
  echo "exit $?"; grep -v "^\[W" $OUT/train_$name.log | sed -n '/tokens\/s/,$p' | head -${LINES_SHOWN:-3}
}
LINES_SHOWN=14 run epi_both --gemm-epilogues --mlp-epilogues both --profile --profile-top 12
run base
LINES_SHOWN=14 run epi_dgrad --gemm-epilogues --mlp-epilogues dgrad --profile --profile-top 12
run epi_fwd --gemm-epilogues --mlp-epilogues fwd


TO=240 LINES_SHOWN=14 run cdt --inductor-config coordinate_descent_tuning=True --profile --profile-top 12
echo "== end $(date +%T)"
