"""What batching concurrent requests could gain on the runtime, measured before choosing a scheduler.

    python examples/batching_gain.py MODEL.powerinfer.gguf [--batch 1 2 4 8] [--repeats 7] [--mode sparse]

A server that batches B requests runs one forward pass over B tokens (one per sequence) instead of B
one-token passes. This times exactly that on the runtime: B sequences, each after a 32-token prompt of its own,
decoded by B one-token forward passes (the compiled decoder) against one ``RuntimeModel.forward_batch`` (each
weight read once for all, each sequence attending over its own cache). The ratio of the two per-token times is
what batching B sequences gains per step (the server's steps time both ways: ``runtime.batching``'s ``_StepChoice``).
Prints, per B, the medians of ``--repeats`` runs, alternating the two.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from powerinfer_tools.benchmarking.bench import bench_tokens
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.runtime.loader import load_runtime_model

PROMPT = 32


def prompted(model, tokens: np.ndarray, b: int) -> list:
    """``b`` sequences' caches, each after a prompt of its own."""
    caches = [model.new_cache() for _ in range(b)]
    for i, cache in enumerate(caches):
        model.forward(np.roll(tokens[:PROMPT], i), cache, all_logits=False)
    return caches


def time_one_by_one(model, tokens: np.ndarray, b: int) -> float:
    caches = prompted(model, tokens, b)
    start = time.perf_counter()
    for token, cache in zip(tokens[PROMPT : PROMPT + b], caches):
        model.forward(np.array([token]), cache, all_logits=False)
    return time.perf_counter() - start


def time_together(model, tokens: np.ndarray, b: int) -> float:
    caches = prompted(model, tokens, b)
    start = time.perf_counter()
    model.forward_batch([tokens[PROMPT + i : PROMPT + i + 1] for i in range(b)], caches)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--mode", choices=["sparse", "dense"], default="sparse")
    args = parser.parse_args()
    model = load_runtime_model(args.model)
    model.mode = FFNMode(args.mode) if model.can_run_sparse else FFNMode.DENSE
    tokens = bench_tokens(args.model, PROMPT + max(args.batch))
    time_one_by_one(model, tokens, 2)  # compile and warm up both paths
    time_together(model, tokens, 2)
    print(f"{args.model} ({model.mode.value} FFN), medians of {args.repeats} runs")
    print("  B | one by one, ms/token | together, ms/token | batching gain")
    for b in args.batch:
        runs = {time_one_by_one: [], time_together: []}
        for _ in range(args.repeats):
            for measure, times in runs.items():
                times.append(measure(model, tokens, b) / b * 1e3)
        alone, together = (statistics.median(t) for t in runs.values())
        print(f"{b:3d} | {alone:20.2f} | {together:18.2f} | {alone / together:6.2f}x")


if __name__ == "__main__":
    main()
