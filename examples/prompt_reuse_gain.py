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
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

WORDS = ("river town market grain merchant warehouse dock harbour ship cargo winter summer road bridge mill "
         "school church farm field orchard letter council railway station lamp street square").split()
STARTUP_SECONDS = 300


def words(count: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(count))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(args, cache: bool) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-c", "from powerinfer_tools.commands.cli import main; main()", "serve",
               str(args.model), "--port", str(port), "--threads", str(args.threads)]
    if not cache:
        command += ["--prompt-cache", "0B"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_SECONDS
    while True:
        if process.poll() is not None:
            raise SystemExit(f"pitools serve exited ({process.returncode})")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"pitools serve did not start in {STARTUP_SECONDS} s")
        time.sleep(0.5)


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
            process, url = serve(args, cache)
            try:
                found[name] += conversations(args, url)
                supplied[name] += reused(url)
            finally:
                process.terminate()
                process.wait(timeout=30)
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
