#!/usr/bin/env bash
# whichever card comes: an H200 runs issue 26's call (call8.sh), an H100 the prefill-graph serving call (call10.sh)
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then exec bash .gpu/call8.sh; fi
exec bash .gpu/call10.sh
