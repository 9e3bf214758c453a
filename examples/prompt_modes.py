"""Prompts of a PowerInfer file by length, three ways: sparse mode's own paths (each token's own neurons, or their
union), sparse mode's long-block path (each token's own up products, then every down row:
``runtime.engine.EVERY_DOWN_ROW_TOKENS``, for the layers whose whole gate chooses the neurons) and dense mode. Where
the long-block path should start is where it overtakes the own paths.

Each length is timed as ``--rounds`` triples of prompts of random token ids, the three ways in turn, in one process
(the machine's drift falls on all alike). Prints the medians' tokens/s and each way over the own paths.

    python examples/prompt_modes.py MODEL.powerinfer.gguf [--tokens 16 32 64 128 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.runtime import engine
from powerinfer_tools.runtime.llm import LLM

WAYS = {"own paths": (FFNMode.SPARSE, sys.maxsize), "own up, every down row": (FFNMode.SPARSE, 1),
        "dense": (FFNMode.DENSE, sys.maxsize)}  # (mode, engine.EVERY_DOWN_ROW_TOKENS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    model = LLM.load(args.model, mode="sparse").engine
    rng = np.random.default_rng(0)
    for n in args.tokens:
        seconds: dict[str, list[float]] = {way: [] for way in WAYS}
        for _ in range(args.rounds + 1):  # a first triple to warm the lengths' arrays, not counted
            tokens = rng.integers(1, model.spec.vocab_size, n)
            for way, times in seconds.items():
                model.mode, engine.EVERY_DOWN_ROW_TOKENS = WAYS[way]
                start = time.perf_counter()
                model.forward(tokens, model.new_cache(), all_logits=False)
                times.append(time.perf_counter() - start)
        medians = {way: statistics.median(times[1:]) for way, times in seconds.items()}
        own = medians["own paths"]
        ways = ", ".join(f"{way} {n / m:7.1f} tok/s ({own / m:.2f}x)" for way, m in medians.items())
        print(f"{n:5d} tokens: {ways}", flush=True)


if __name__ == "__main__":
    main()
