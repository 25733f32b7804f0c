#!/usr/bin/env bash
# Any GPU (an H200 for issue 25's figures): the decode GPU tests that never ran on the final code (the graph-dict
# split of 2c99bc8 and the review refactor c8bb37c), then the server with its HTTP front-end on a thread (default)
# and in a process of its own (--frontend process, remote.py), same machine, same run, against the engine alone.
# Copy to .gpu/ and run: BUDGET=570 bash .gpu/i25_serving.sh
set -uo pipefail
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
left() { echo $(( ${BUDGET:-570} - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
echo "== decode GPU tests $(date +%T)"
timeout 130 python3 -m pytest -q -p no:cacheprovider -W ignore tests/gpu/test_decode_graph_gemm.py \
  tests/gpu/test_inference.py > $OUT/gpu_decode.log 2>&1
echo "exit $?"; grep -E "passed|failed|^FAILED" $OUT/gpu_decode.log | tail -8
for frontend in process thread; do
  echo "== serving, --frontend $frontend $(date +%T) (left $(left)s)"
  timeout $(( $(left) / 2 > 200 ? 200 : $(left) - 5 )) python3 benchmarks/serving_speed.py --device cuda \
    --clients 8 32 64 --repeats 2 --frontend $frontend --output $OUT/serving_$frontend.json > $OUT/serving_$frontend.log 2>&1
  echo "exit $?"; grep -v "^\[W" $OUT/serving_$frontend.log | grep -v "^per engine round" | tail -12 | cut -c1-300
done
echo "== end $(date +%T) (left $(left)s)"
