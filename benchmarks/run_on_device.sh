#!/usr/bin/env bash
# One GPU-machine session: install the carried DeepSpeed wheels, run the GPU tests, then the training benchmarks.
# Usage (from the device tool, with .whl carried): bash benchmarks/run_on_device.sh [benchmark flags...]
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -p no:cacheprovider tests/gpu > "$OUT/gpu_tests_full.txt" 2>&1
  tail -15 "$OUT/gpu_tests_full.txt" | tee "$OUT/gpu_tests.txt"
fi
n=0
for spec in "${@:-}"; do
  n=$((n + 1))
  echo "== benchmark_training $spec" | tee -a "$OUT/benchmark.txt"
  # The whole output goes to $OUT; the table (and the profile's top kernels) to the terminal.
  python3 tools/benchmark_training.py $spec --output "$OUT/benchmark_$n.json" > "$OUT/benchmark_$n.log" 2>&1
  grep -v "^\[W" "$OUT/benchmark_$n.log" | sed -n '/^model {/,$p' | tee -a "$OUT/benchmark.txt"
done
