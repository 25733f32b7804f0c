#!/usr/bin/env bash
# whichever card comes: an H200 runs issue 26's call (call3.sh), an H100 the serving diagnosis (call6a.sh)
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then exec bash .gpu/call8.sh; fi
exec bash .gpu/call6a.sh
