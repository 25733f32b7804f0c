#!/usr/bin/env bash
# Training throughput of this tree against another revision, interleaved on the same GPU in one call (A B A B), so
# that a code change is told apart from the device's own drift. Run from the repository root with .whl carried:
#   git archive <rev> -o .base.tar            # here, before the device call (carry .whl and .base.tar)
#   bash benchmarks/training_ab.sh .base.tar [rounds] [benchmark_training flags...]
# Prints tokens/s per run and the JSON of each run lands in $OUT/{this,base}_<round>.json.
set -uo pipefail
base_tar=$1; rounds=${2:-2}; shift $(( $# >= 2 ? 2 : $# ))
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=/tmp/site/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/torch_extensions OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/base && tar -xf "$base_tar" -C /tmp/base
here=$PWD
for round in $(seq 1 "$rounds"); do
  for side in this base; do
    dir=$here; [ "$side" = base ] && dir=/tmp/base
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir python3 tools/benchmark_training.py --skip-hf "$@" \
      --output "$OUT/${side}_$round.json" > "$OUT/${side}_$round.log" 2>&1)
    echo "$side round $round: $(grep -E '^ours ' "$OUT/${side}_$round.log" | tr -s ' ')"
  done
done
