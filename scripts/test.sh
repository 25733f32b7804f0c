#!/usr/bin/env bash
# Runs the test suite in .venv (made by scripts/setup.sh). Extra arguments go to pytest.
# Compiled DeepSpeed ops are cached in .cache/torch_extensions so they build once.
set -uo pipefail
cd "$(dirname "$0")/.."
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests" >&2
fi
exit "$rc"
