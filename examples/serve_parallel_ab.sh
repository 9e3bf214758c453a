#!/bin/bash
# pitools serve --parallel 4 against --parallel 1 on SmolLM2 (MODEL to change it), CLIENTS clients (8), 32 requests of
# WORDS words (20) and TOKENS tokens (64), alternating; prints each run's figures and batch metrics. docs/lab/serving.md.
M=${MODEL:-$HOME/.cache/pitools/models/SmolLM2-135M-Instruct.Q4_1.gguf}
for np in 4 1; do
  port=$((18000 + np))
  nice -n 19 python -c "from powerinfer_tools.commands.cli import main; main()" serve $M --port $port -t 2 --parallel $np --model-name m > ${OUT:-/tmp}/np$np.log 2>&1 &
  pid=$!
  until curl -s http://127.0.0.1:$port/health > /dev/null; do sleep 0.5; done
  nice -n 19 python examples/serve_load_test.py --url http://127.0.0.1:$port --model m --clients ${CLIENTS:-8} --requests 32 --words ${WORDS:-20} --max-tokens ${TOKENS:-64} --temperature 0.7 --stream-share 0 --chat-share 0 --out ${OUT:-/tmp}/np$np.json > /dev/null
  curl -s http://127.0.0.1:$port/metrics | grep -E "^pitools_batch|^pitools_generation_tokens|^pitools_prompt_seconds" 
  kill $pid; wait $pid 2>/dev/null
  python -c "import json; r=json.load(open('${OUT:-/tmp}/np$np.json')); print('parallel $np', round(r['requests_per_second'],2), 'req/s', round(r['completion_tokens_per_second'],1), 'tok/s p50', round(r['latency_seconds']['p50'],2), 'p99', round(r['latency_seconds']['p99'],2))"
  cut -d' ' -f1-3 /proc/loadavg
done
