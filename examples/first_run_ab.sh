#!/bin/bash
# A first `pitools run` on a machine without compiled kernels, by --kernels policy, alternating:
#   bash examples/first_run_ab.sh MODEL.gguf [ROUNDS] > report.json
# Each run gets an empty numba cache of its own (NUMBA_CACHE_DIR, which also holds the build markers), so each is
# a first run; a background build is let finish before the next run starts. Prints one JSON object: per run the
# policy, the wall time from start to exit, and run's summary line.
set -euo pipefail
model=$1; rounds=${2:-2}
runs=()
for round in $(seq "$rounds"); do
  for policy in background wait; do
    cache=$(mktemp -d)
    start=$(date +%s.%N)
    NUMBA_CACHE_DIR=$cache pitools run "$model" -p "Once upon a time" -n 64 --kernels "$policy" \
      > /dev/null 2> "$cache/stderr"
    end=$(date +%s.%N)
    summary=$(tail -1 "$cache/stderr")
    while pgrep -f "powerinfer_tools.runtime.warmup" > /dev/null; do sleep 1; done
    runs+=("$(python3 -c 'import json,sys; print(json.dumps({"round": int(sys.argv[1]), "policy": sys.argv[2],
      "seconds": round(float(sys.argv[4]) - float(sys.argv[3]), 2), "summary": sys.argv[5]}))' \
      "$round" "$policy" "$start" "$end" "$summary")")
    rm -rf "$cache"
  done
done
python3 -c 'import json,sys; print(json.dumps({"model": sys.argv[1], "tokens": 64, "runs": [json.loads(r) for r in sys.argv[2:]]}, indent=1))' \
  "$model" "${runs[@]}"
