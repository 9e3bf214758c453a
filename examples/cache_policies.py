"""Neuron cache settings on one token trace: hit rate, disk bytes and speed by eviction policy and cache share.

    python examples/cache_policies.py MODEL.powerinfer.gguf --ram 300MiB [--tokens 128] [--prompt 64]

Runs the runtime (sparse, the Python API's loader) under ``--ram`` on the bench's tokens (the shipped
held-out text, as ``pitools bench`` reads it): a ``--prompt``-token prompt, then ``--tokens`` decoding
steps, once per policy (``neuron_cache.POLICIES``) and share of the neuron budget given to cache slots
(the rest pins the hottest neurons). The predictors' choices do not depend on the cache, so every
setting sees the same trace of neurons. Prints one line per setting: the decoding steps' hit rate (of
the cold neurons computed, the share found in a cache), MB read from disk per token and tokens/s.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from powerinfer_tools.benchmarking.bench import bench_tokens
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.runtime.engine import TokenStats
from powerinfer_tools.runtime.loader import load_runtime_model
from powerinfer_tools.runtime.neuron_cache import POLICIES
from powerinfer_tools.units import parse_size

SHARES = (0.1, 0.25, 0.5)


def measure(path, ram: int, policy: str, share: float, tokens: np.ndarray, prompt: int) -> tuple[TokenStats, float]:
    model = load_runtime_model(path, ram=ram, cache_policy=policy, cache_share=share)
    model.mode = FFNMode.SPARSE
    caches = model.new_cache()
    model.forward(tokens[:prompt], caches, all_logits=False)
    model.stats = TokenStats()
    start = time.perf_counter()
    for token in tokens[prompt:]:
        model.forward(np.array([token]), caches, all_logits=False)
    return model.stats, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--ram", required=True)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=64)
    args = parser.parse_args()
    ram = parse_size(args.ram, "--ram")
    tokens = bench_tokens(args.model, args.prompt + args.tokens)
    print(f"{args.model}, --ram {args.ram}, {args.prompt}-token prompt, {args.tokens} decoding steps")
    for share in SHARES:
        for policy in POLICIES:
            stats, seconds = measure(args.model, ram, policy, share, tokens, args.prompt)
            print(f"policy {policy:4} cache share {share:4.2f}: hit rate {stats.hit_rate:6.1%}, "
                  f"{stats.disk_bytes / stats.steps / 1e6:6.2f} MB/token from disk, {stats.steps / seconds:6.2f} tok/s")


if __name__ == "__main__":
    main()
