"""Profile folders written directly, without a model: chosen inputs, and which neurons fire on each, per layer.
For the predictor tests that need firing of a known shape (tests/test_predictors.py, tests/test_ray.py)."""

from __future__ import annotations

import numpy as np
from powerinfer_tools.formats.profile_folder import FORMAT as PROFILE_FORMAT
from powerinfer_tools.formats.profile_folder import PAIRS_DIR, PROFILE_JSON, STATS_FILE, FiringStats, PairStore

from powerinfer_tools.fileio import write_json


def write_synthetic_profile(folder, x, fired_per_layer):
    """A profile folder (layout of formats/README.md) holding the given pairs for each layer."""
    n, d_model = x.shape
    d_ff = fired_per_layer[0].shape[1]
    store = PairStore.create(folder / PAIRS_DIR, len(fired_per_layer), d_model, d_ff, n)
    for layer, fired in enumerate(fired_per_layer):
        store.write(layer, 0, x, fired)
    store.flush()
    fire = np.stack([f.sum(0) for f in fired_per_layer]).astype(np.int64)
    FiringStats(fire, fire.astype(np.float64), n).save(folder / STATS_FILE, {})
    write_json(folder / PROFILE_JSON, {
        "model": "synthetic", "format": PROFILE_FORMAT, "architecture": "llama", "ffn": "reglu",
        "n_layers": len(fired_per_layer), "d_model": d_model, "d_ff": d_ff, "corpus_sha256": "0", "tokens": n,
        "pairs_capacity": n, "progress": {"complete": True},
    })
