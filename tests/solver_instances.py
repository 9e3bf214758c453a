"""Random placement instances shared by the solver tests (two tiers and three)."""

from __future__ import annotations

import numpy as np


def random_stats(rng: np.random.Generator, n_layers: int, n_ff: int) -> dict:
    """``problem_from_stats``'s inputs for a random model: skewed firing rates, as profiled ones are."""
    freqs = rng.uniform(0, 1, (n_layers, n_ff)) ** 3
    freqs[rng.uniform(size=freqs.shape) < 0.1] = 0.0
    return {
        "freqs": freqs,
        "neuron_bytes": rng.integers(1_000, 20_000, n_layers),
        "dense_bytes": rng.integers(5_000, 60_000, n_layers),
        "predictor_bytes": rng.integers(0, 10_000, n_layers),
        "kv_bytes_per_token": rng.integers(10, 200, n_layers),
        "head_bytes": int(rng.integers(5_000, 80_000)),
        "hidden_bytes": 256,
    }
