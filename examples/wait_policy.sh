#!/bin/bash
# pitools run -n 64 --temp 0 with OpenMP's waiting threads asleep (passive) or at libgomp's default (set empty,
# which also keeps `run` from choosing for itself), alternating; prints the summary lines.
M=${1:-$HOME/.cache/pitools/models/SmolLM2-135M-Instruct.Q4_1.gguf}
for round in 1 2 3; do
  for policy in passive ""; do
    echo "round $round OMP_WAIT_POLICY='$policy' load $(cut -d' ' -f1 /proc/loadavg)"
    OMP_WAIT_POLICY="$policy" nice -n 19 pitools run "$M" -n 64 --temp 0 --threads 2 --mode dense -p "The history of the city" 2>&1 >/dev/null | grep -o "generation: [^|]*"
  done
done
