"""Prompts of a PowerInfer file in sparse and in dense mode, by length: where a block of tokens should compute every
neuron (``runtime.engine.WHOLE_GATE_DENSE_TOKENS``, for the layers whose whole gate chooses the neurons).

Each length is timed as ``--rounds`` pairs of prompts of random token ids, sparse then dense, in one process (the
machine's drift falls on both alike); sparse mode's own paths are timed as they run below the limit (each token's
own neurons, or their union), the limit lifted. Prints the medians' tokens/s and dense over sparse.

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    model = LLM.load(args.model, mode="sparse").engine
    engine.WHOLE_GATE_DENSE_TOKENS = sys.maxsize  # sparse mode's own paths at every length
    rng = np.random.default_rng(0)
    for n in args.tokens:
        seconds: dict[FFNMode, list[float]] = {FFNMode.SPARSE: [], FFNMode.DENSE: []}
        for _ in range(args.rounds + 1):  # a first pair to warm the lengths' arrays, not counted
            tokens = rng.integers(1, model.spec.vocab_size, n)
            for mode, times in seconds.items():
                model.mode = mode
                start = time.perf_counter()
                model.forward(tokens, model.new_cache(), all_logits=False)
                times.append(time.perf_counter() - start)
        sparse, dense = (statistics.median(times[1:]) for times in seconds.values())
        print(f"{n:5d} tokens: sparse {n / sparse:7.1f} tok/s, dense {n / dense:7.1f} tok/s, dense / sparse "
              f"{sparse / dense:.2f}x", flush=True)


if __name__ == "__main__":
    main()
