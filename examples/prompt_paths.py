"""Where a sparse prompt should stop computing each token's own neurons: the two block paths timed by density.

A block of tokens (a prompt) of a PowerInfer file with predictors computes either each token's own predicted
neurons (``kernels.batched``: work in proportion to their share) or the union of them all with the products'
matrix kernels (``FFNPartition.compute``: nearly every neuron of a long prompt, whatever the share).
``runtime.engine.OWN_NEURONS_DENSITY`` is where they cross. This script runs the bench's first
``--tokens`` tokens as one prompt in sparse mode, each path in turn, with every token's predicted neurons
thinned at random to a range of shares (each kept with probability ``keep``), and prints the fastest of
``--repeats`` prompts per share and path.

    python examples/prompt_paths.py MODEL.powerinfer.gguf [--tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from powerinfer_tools import kernels
from powerinfer_tools.benchmarking.bench import bench_tokens
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.runtime import engine
from powerinfer_tools.runtime.loader import load_runtime_model

KEEP = (0.2, 0.35, 0.5, 0.7, 1.0)


def thinning(keep: dict, shares: list[float]):
    """A ``RuntimeModel._select`` that keeps each of a block's predicted neurons with probability ``keep["p"]``,
    noting each block's share of neurons computed in ``shares``."""
    select, rng = engine.RuntimeModel._select, np.random.default_rng(0)

    def thinned(self, layer, plan, partitions, predictor, h, residual):
        active, mask = select(self, layer, plan, partitions, predictor, h, residual)
        if h.shape[0] == 1:
            return active, mask
        mask = mask & (rng.random(mask.shape) < keep["p"])
        used = mask.any(axis=0)
        shares.append(mask.sum() / mask.shape[0] / layer.d_ff)
        return active[used], mask[:, used]

    return thinned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    kernels.set_threads(2)
    model = load_runtime_model(args.model, use_split=False)
    model.mode = FFNMode.SPARSE
    tokens = bench_tokens(args.model, args.tokens)
    keep, shares = {}, []
    engine.RuntimeModel._select = thinning(keep, shares)
    paths = {"own neurons": 1.01, "union": 0.0}  # the limit that makes every block take the path
    for keep["p"] in KEEP:
        for name, limit in paths.items():
            engine.OWN_NEURONS_DENSITY = limit
            times = []
            for _ in range(args.repeats):
                shares.clear()
                started = time.perf_counter()
                model.forward(tokens, model.new_cache(), all_logits=False)
                times.append(time.perf_counter() - started)
            print(f"neurons computed {np.mean(shares):6.1%}  {name:>11}: {min(times):.3f} s "
                  f"(median {np.median(times):.3f})", flush=True)


if __name__ == "__main__":
    main()
