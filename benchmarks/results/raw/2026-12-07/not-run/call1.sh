#!/usr/bin/env bash
# 2026-12-07, ~340 s of device time left: the GPU tests of what landed untested on a GPU (the DGELU epilogue's final
# code, the decode-graph tests that failed on the graph dict's keys), then the default training step (DGELU on).
set -uo pipefail
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
echo "== GPU tests $(date +%T)"
timeout 120 python3 -m pytest -q -p no:cacheprovider -W ignore tests/gpu/test_gemm_epilogue.py \
  tests/gpu/test_decode_graph_gemm.py tests/gpu/test_inference.py > $OUT/gpu_tests.log 2>&1
echo "exit $?"; grep -E "passed|failed|Error|^FAILED" $OUT/gpu_tests.log | tail -12
echo "== train: --skip-hf --compile-blocks (gemm epilogues by default) $(date +%T), $(( $(date +%s) - T0 )) s in"
timeout 150 python3 tools/benchmark_training.py --skip-hf --compile-blocks --profile --profile-top 12 \
  --output $OUT/train.json > $OUT/train.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/train.log | grep -iE "tokens/s|epilogue|profile of|warn" | head -12
echo "== end $(date +%T), $(( $(date +%s) - T0 )) s"
