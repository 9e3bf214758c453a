"""What prompt reuse gains a conversation: `pitools serve` with its prompt cache and without it (``--prompt-cache
0B``), the same multi-turn conversations sent to each in turn.

Each conversation starts from a system prompt of ``--system-words`` words; every turn sends, as a non-streamed
completion, the whole conversation so far (the system prompt, each earlier turn's question and answer) and a new
question of ``--question-words`` words, and takes ``--tokens`` tokens back (greedy), as a chat client does. With
the cache, a turn's prompt begins with what the last turn's generation left in the cache, so only the new question
is computed. Prints, per server, the median latency of the first turns and of the later ones, and the prompt
tokens the cache supplied (``/metrics``' ``pitools_prompt_tokens_reused_total``); ``--json`` writes every latency.

    python examples/prompt_reuse_gain.py MODEL [--conversations 4] [--turns 6] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import httpx

from serve_side_by_side import free_port, server  # a sibling example's: the server, up while in use

WORDS = ("river town market grain merchant warehouse dock harbour ship cargo winter summer road bridge mill "
         "school church farm field orchard letter council railway station lamp street square").split()


def words(count: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(count))


def serve(args, cache: bool, port: int):
    """`pitools serve` on ``port``, with its prompt cache or without (``--prompt-cache 0B``), while in use."""
    command = [sys.executable, "-c", "from powerinfer_tools.commands.cli import main; main()", "serve",
               str(args.model), "--port", str(port), "--threads", str(args.threads)]
    return server(command + ([] if cache else ["--prompt-cache", "0B"]), port)


def conversations(args, url: str) -> list[list[float]]:
    """Each conversation's turn latencies, in seconds."""
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    latencies = []
    for c in range(args.conversations):
        text, turns = f"System: {words(args.system_words, c)}.", []
        for turn in range(args.turns):
            text += f"\nUser: {words(args.question_words, c * 100 + turn)}?\nAssistant:"
            start = time.perf_counter()
            answer = httpx.post(f"{url}/v1/completions", timeout=600, json={
                "model": model, "prompt": text, "max_tokens": args.tokens, "temperature": 0}).json()
            turns.append(time.perf_counter() - start)
            text += answer["choices"][0]["text"]
        latencies.append(turns)
    return latencies


def reused(url: str) -> int:
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    return int(float(re.search(r"^pitools_prompt_tokens_reused_total ([\d.e+]+)$", metrics, re.M).group(1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-words", type=int, default=150)
    parser.add_argument("--question-words", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="Each server in turn, this many times.")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    found: dict[str, list] = {"with the prompt cache": [], "without (--prompt-cache 0B)": []}
    supplied = dict.fromkeys(found, 0)
    for _ in range(args.rounds):
        for name, cache in zip(found, (True, False)):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            with serve(args, cache, port):
                found[name] += conversations(args, url)
                supplied[name] += reused(url)
    print(f"{args.conversations} conversations x {args.turns} turns, {args.rounds} rounds; median latency (s):")
    for name, latencies in found.items():
        first = statistics.median(turns[0] for turns in latencies)
        later = statistics.median(t for turns in latencies for t in turns[1:])
        print(f"  {name:>28}: first turn {first:6.3f}, later turns {later:6.3f}; "
              f"prompt tokens from the cache {supplied[name]}")
    if args.json is not None:
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                         "latencies": found, "reused_tokens": supplied}, indent=2))


if __name__ == "__main__":
    main()
