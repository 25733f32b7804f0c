#!/usr/bin/env bash
# Whichever card comes: an H200 runs issue 26's must-show (i26_h200.sh), any other the H100 fallback.
# Run: BUDGET=520 bash benchmarks/results/raw/2026-12-07/not-run/either.sh
here=benchmarks/results/raw/2026-12-07/not-run
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  exec bash $here/i26_h200.sh
else
  exec bash $here/h100_fallback.sh
fi
