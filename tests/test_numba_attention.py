"""A prompt's compiled attention (kernels/numba_attention.py) against ``layers.attention`` in float64: every shape
the tiles meet (a short last tile, keys already cached, a window that ends inside a tile, grouped and plain heads,
both value widths), scores far apart (its exp's floor), soft-capped scores (Gemma 2), and which blocks the CPU backend
hands it; and a batch's step, one query per sequence over caches of their own lengths (``one_query_each``), capped or
not."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from powerinfer_tools import kernels
from powerinfer_tools.kernels import numba_attention
from powerinfer_tools.kernels import numba_kernels as nk
from powerinfer_tools.models.layers import KVCache, attention, attention_each, score_scale
from powerinfer_tools.runtime.backends import CpuBackend

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the compiled kernels are unavailable")


def inputs(seed: int, n_tokens: int, start: int, n_heads: int, n_kv: int, head_dim: int, spread: float = 1.0):
    rng = np.random.default_rng(seed)
    q = (spread * rng.standard_normal((n_tokens, n_heads, head_dim))).astype(np.float32)
    keys, values = (rng.standard_normal((start + n_tokens, n_kv, head_dim)).astype(np.float32) for _ in range(2))
    return q, keys, values


def float64_attention(q, keys, values, start, window, scale, softcap=None):
    return attention(*(a.astype(np.float64) for a in (q, keys, values)), start, window, scale, softcap)


def float64_attention_each(q, stored, window, scale, softcap=None):
    return attention_each(q.astype(np.float64), [(k.astype(np.float64), v.astype(np.float64)) for k, v in stored],
                          window, scale, softcap)


# Gemma 2's attention cap is 50; 5 bites on these scores (spread out so that many pass it), which the tests check.
SOFTCAP = 5.0


@pytest.mark.parametrize("n_tokens, start, n_heads, n_kv, head_dim, window", [
    (4, 0, 2, 1, 64, None),      # one whole tile
    (7, 0, 4, 2, 64, None),      # a short last tile (its spare rows repeat its last token)
    (33, 10, 8, 2, 64, None),    # keys already cached before the block
    (70, 0, 32, 4, 64, None),    # TinyLlama's grouping: 8 heads a key
    (45, 3, 4, 1, 256, 20),      # Gemma 3's heads; a window ending inside tiles and inside score blocks
    (21, 100, 4, 1, 256, 64),    # a window wholly within the cached keys
    (19, 0, 6, 6, 80, None),     # no grouping; 80 wide: the values summed 16 at a time
    (130, 0, 3, 3, 16, 37),
])
@pytest.mark.parametrize("threads", [1, 2])
def test_equals_the_reference(n_tokens, start, n_heads, n_kv, head_dim, window, threads):
    q, keys, values = inputs(n_tokens + start + head_dim, n_tokens, start, n_heads, n_kv, head_dim)
    scale = score_scale(head_dim, None)
    expected = float64_attention(q, keys, values, start, window, scale)
    kernels.set_threads(threads)
    try:
        got = kernels.causal_attention(q, keys, values, start, window, scale)
    finally:
        kernels.set_threads(nk.numba.config.NUMBA_NUM_THREADS)
    assert got.shape == (n_tokens, n_heads * head_dim) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-6 * np.abs(expected).max())


def test_scores_far_apart():
    """Scores hundreds apart: most weights fall under the exp's floor (exactly 0), the largest carries the row,
    as in float64."""
    q, keys, values = inputs(5, 40, 0, 4, 2, 64, spread=60.0)
    expected = float64_attention(q, keys, values, 0, None, 0.125)
    got = kernels.causal_attention(q, keys, values, 0, None, 0.125)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


@njit
def _exp(x, shift):
    return numba_attention._exp_in_place(x.ctypes.data, x.shape[0] // numba_attention.EXP_LANES, shift)


@pytest.mark.parametrize("n_tokens, start, n_heads, n_kv, head_dim, window", [
    (7, 0, 4, 2, 64, None),     # a short last tile
    (45, 3, 4, 2, 256, 20),     # Gemma 2's heads and a window ending inside tiles
    (21, 100, 8, 4, 64, 64),    # a window within the cached keys
])
def test_soft_capped_scores_equal_the_reference(n_tokens, start, n_heads, n_kv, head_dim, window):
    """Scores scaled, then capped at SOFTCAP before the mask and softmax, as ``layers.attention`` caps them; the
    cap changes the result far beyond the tolerance, so a kernel that ignored it would fail."""
    q, keys, values = inputs(n_tokens + head_dim, n_tokens, start, n_heads, n_kv, head_dim, spread=4.0)
    scale = score_scale(head_dim, None)
    expected = float64_attention(q, keys, values, start, window, scale, SOFTCAP)
    got = kernels.causal_attention(q, keys, values, start, window, scale, SOFTCAP)
    tolerance = 2e-6 * np.abs(expected).max()
    np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance)
    uncapped = float64_attention(q, keys, values, start, window, scale)
    assert np.abs(uncapped - expected).max() > 1000 * tolerance
    np.testing.assert_array_equal(CpuBackend().attention(q, keys, values, start, window, None, SOFTCAP), got)


def test_exp_within_float32_rounding():
    x = np.linspace(-120.0, 10.0, 16 * 4096).astype(np.float32)
    shifted = x - np.float32(2.0)  # rounded to float32 as the kernel's is
    expected = np.exp(shifted.astype(np.float64))
    got = x.copy()
    total = _exp(got, np.float32(2.0))
    normal = shifted >= numba_attention.EXP_FLOOR
    np.testing.assert_allclose(got[normal], expected[normal], rtol=3e-7)
    assert not got[~normal].any()  # under the floor: exactly 0
    assert total == pytest.approx(expected[normal].sum(), rel=1e-6)


def test_the_cpu_backend_takes_prompts_alone():
    """A block of a tile's tokens or more takes the kernel; fewer, and heads the value sums do not divide, keep
    NumPy's."""
    assert kernels.attention_takes(kernels.ATTENTION_MIN_TOKENS, 64)
    assert kernels.ATTENTION_MIN_TOKENS == numba_attention.QUERIES
    assert not kernels.attention_takes(kernels.ATTENTION_MIN_TOKENS - 1, 64)
    assert not kernels.attention_takes(64, 40)
    q, keys, values = inputs(9, 12, 5, 4, 2, 40)
    np.testing.assert_array_equal(CpuBackend().attention(q, keys, values, 5, None, None),
                                  attention(q, keys, values, 5, None, None))
    q, keys, values = inputs(9, 12, 5, 4, 2, 64)
    np.testing.assert_array_equal(CpuBackend().attention(q, keys, values, 5, None, None),
                                  kernels.causal_attention(q, keys, values, 5, None, 0.125))


def test_refuses_mismatched_shapes():
    q, keys, values = inputs(1, 8, 0, 4, 2, 64)
    with pytest.raises(ValueError, match="attention of q"):
        kernels.causal_attention(q, keys[:-1], values[:-1], 0, None, 0.125)


@pytest.mark.parametrize("lengths, n_heads, n_kv, head_dim, window", [
    ([1, 2], 2, 1, 64, None),              # a first token: one key
    ([17, 100, 33, 64], 32, 4, 64, None),  # TinyLlama's heads, caches past and on blocks of the exp's lanes
    ([45, 3, 300], 4, 1, 256, 20),         # Gemma 3's heads and local window: one within it, two past it
    ([70, 16], 6, 6, 80, 16),              # no grouping; a window ending on a block's edge
])
@pytest.mark.parametrize("threads", [1, 2])
def test_one_query_each_equals_the_reference(lengths, n_heads, n_kv, head_dim, window, threads):
    q, stored = one_query_inputs(lengths, n_heads, n_kv, head_dim)
    scale = score_scale(head_dim, None)
    expected = float64_attention_each(q, stored, window, scale)
    kernels.set_threads(threads)
    try:
        got = kernels.one_query_each(q, stored, window, scale)
    finally:
        kernels.set_threads(nk.numba.config.NUMBA_NUM_THREADS)
    assert got.shape == (len(lengths), n_heads * head_dim) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-6 * np.abs(expected).max())
    np.testing.assert_array_equal(CpuBackend().attention_each(q, stored, window, None), got)


def one_query_inputs(lengths: list[int], n_heads: int, n_kv: int, head_dim: int, spread: float = 1.0):
    """Queries ``[B, heads, hd]`` and each sequence's (keys, values) of its length, as the engine keeps them: rows
    of a cache's buffer."""
    rng = np.random.default_rng(sum(lengths) + head_dim)
    q = (spread * rng.standard_normal((len(lengths), n_heads, head_dim))).astype(np.float32)
    caches = [KVCache(1, n_kv, head_dim, np.float32) for _ in lengths]
    stored = [c.store(0, *(rng.standard_normal((n, n_kv, head_dim)).astype(np.float32) for _ in range(2)))
              for c, n in zip(caches, lengths)]
    return q, stored


def test_one_query_each_soft_caps_as_the_reference():
    """Gemma 2's cap on a batch's step (``one_head``, which the compiled decoder's one token runs too): within the
    tolerance of the float64 reference, far beyond it from the uncapped result."""
    q, stored = one_query_inputs([45, 3, 300], 4, 2, 256, spread=4.0)
    scale = score_scale(256, None)
    expected = float64_attention_each(q, stored, 20, scale, SOFTCAP)
    got = kernels.one_query_each(q, stored, 20, scale, SOFTCAP)
    tolerance = 2e-6 * np.abs(expected).max()
    np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance)
    assert np.abs(float64_attention_each(q, stored, 20, scale) - expected).max() > 1000 * tolerance
    np.testing.assert_array_equal(CpuBackend().attention_each(q, stored, 20, None, SOFTCAP), got)


def test_one_query_each_refuses_mismatched_shapes():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)
    keys = rng.standard_normal((5, 2, 64)).astype(np.float32)
    with pytest.raises(ValueError, match="one query each"):
        kernels.one_query_each(q, [(keys, keys[:-1]), (keys, keys)], None, 0.125)
    with pytest.raises(ValueError, match="one query each"):
        kernels.one_query_each(q, [(keys, keys)], None, 0.125)  # a sequence short
    with pytest.raises(ValueError, match="one query each"):
        kernels.one_query_each(q, [(keys[:, :1, :32], keys[:, :1, :32])] * 2, None, 0.125)
