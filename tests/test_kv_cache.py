"""The reference engine's KV cache (``models/layers.py`` ``KVCache``): it grows, keeping what it held."""

import numpy as np

from powerinfer_tools.models.layers import KVCache


def test_a_cache_grown_past_its_capacity_keeps_every_stored_position():
    rng = np.random.default_rng(0)
    cache = KVCache(n_layers=2, n_kv_heads=3, head_dim=4, dtype=np.float32, capacity=4)
    stored_k, stored_v = [], []
    for step_tokens in (3, 1, 5, 1, 9):  # grows 4 -> 8 -> 16 -> 32 within a layer's store
        k, v = rng.standard_normal((2, step_tokens, 3, 4)).astype(np.float32)
        for layer in range(2):
            keys, values = cache.store(layer, k + layer, v - layer)
        cache.advance(step_tokens)
        stored_k.append(k), stored_v.append(v)
        np.testing.assert_array_equal(keys, np.concatenate(stored_k) + 1)
        np.testing.assert_array_equal(values, np.concatenate(stored_v) - 1)
    assert cache.keys.shape[1] >= cache.length == 19
    first_layer_keys, _ = cache.store(0, np.zeros((0, 3, 4), np.float32), np.zeros((0, 3, 4), np.float32))
    np.testing.assert_array_equal(first_layer_keys, np.concatenate(stored_k))
