#!/usr/bin/env bash
# Creates .venv in the repository root and installs the project with its test extras.
# torch is installed first and pinned to the CPU build that lies on these machines;
# on a GPU machine, set TORCH_SPEC (e.g. TORCH_SPEC=torch) to take the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
python -m pip install -q -e ".[test]"
