#!/usr/bin/env bash
# One GPU-machine call for issue 23: the environment check (fused kernels self-tested), the collectives check on
# the GPUs present (one GPU: it says what it cannot measure), then predicted vs measured peak memory.
# Usage (device tool, .whl carried): bash benchmarks/planning_session.sh     (about 5 minutes on one H200)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
start=$(date +%s)
timeout 240 python3 tools/check_environment.py --save /tmp/ckpt_check 2>&1 | tee "$OUT/check_environment.txt"
echo "== check_environment: $(( $(date +%s) - start )) s (rc ${PIPESTATUS[0]})"
start=$(date +%s)
timeout 60 torchrun --nproc_per_node "$gpus" tools/check_environment.py --collectives --max-bytes 256M \
  --json "$OUT/collectives.json" 2>&1 | grep -v "^\[W" | tee "$OUT/collectives.txt"
echo "== collectives: $(( $(date +%s) - start )) s"
start=$(date +%s)
timeout 330 python3 benchmarks/memory_prediction.py --output "$OUT/memory_prediction.json" \
  > "$OUT/memory_prediction.log" 2>&1
grep -v "^\[W" "$OUT/memory_prediction.log" | grep -v "^ *$" | tail -25
echo "== memory_prediction: $(( $(date +%s) - start )) s"
