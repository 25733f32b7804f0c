#!/usr/bin/env bash
# H100 call (no H200 came): the server with the bench's clients in 8 processes (029ca88) at 1/8/32/64 clients, then
# 32/64 with all clients in one process (--client-processes 1, as before), then 32/64 with httptools + uvloop
# installed (uvicorn's auto choice; carry .whl-http), on the same machine.
# Run: BUDGET=200 bash benchmarks/results/raw/2026-12-07/not-run/h100_serving.sh
set -uo pipefail
T0=$(date +%s)
source benchmarks/device_setup.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/site-http .whl-http/*.whl || echo "no .whl-http"
for variant in "default::--clients 1 8 32 64 --repeats 2" "oneproc::--clients 32 64 --repeats 2 --client-processes 1" \
               "http:/tmp/site-http:--clients 32 64 --repeats 2"; do
  name=${variant%%:*}; rest=${variant#*:}; extra=${rest%%:*}; flags=${rest#*:}
  echo "== serving $flags ${extra:+(PYTHONPATH $extra first)} $(date +%T) (left $(left)s)"
  [ $(left) -lt 45 ] && break
  PYTHONPATH=${extra:+$extra:}$PYTHONPATH timeout $(( $(left) > 105 ? 100 : $(left) - 5 )) \
    python3 benchmarks/serving_speed.py --device cuda $flags --output $OUT/serving_$name.json > $OUT/serving_$name.log 2>&1
  echo "exit $?"; grep -v "^\[W" $OUT/serving_$name.log | grep -v "^per engine round" | tail -13 | cut -c1-230
done
echo "== end $(date +%T) (left $(left)s)"
