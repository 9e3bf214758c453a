"""q4_K rows times one token with AVX-512 VNNI (kernels/numba_kquants.py), behind ggml's vec_dot interface: the
function against ggml's own vec_dot (the same integer sums, another float32 order) and the NumPy reference (within
the q8_K rounding of x), on rows llama.cpp's quantizer wrote and on rows of random bytes, whose scales and mins
reach every value; and the runtime taking it for q4_K rows, and only for them.

Skipped, with the reason, on a CPU without AVX-512 VNNI (the runtime then keeps ggml's vec_dot).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from powerinfer_tools import kernels
from powerinfer_tools.formats.weight_types import WEIGHT_TYPES
from powerinfer_tools.kernels import ggml_base, numba_kquants
from powerinfer_tools.kernels.quant import QuantMatrix

pytestmark = pytest.mark.skipif(not (kernels.available() and numba_kquants.available()),
                                reason="this CPU lacks AVX-512 VNNI (or the compiled kernels are unavailable)")

Q4_K_BLOCK = WEIGHT_TYPES[Q.Q4_K].block_bytes


def _routines():
    """ggml's q4_K routine as ggml_ops loaded it, and the same with our vec_dot."""
    from powerinfer_tools.kernels import ggml_ops

    theirs = ggml_ops.load().routines[Q.Q4_K]
    return theirs, dataclasses.replace(theirs, vec_dot=numba_kquants.vec_dot_addresses()[int(Q.Q4_K)])


def _random_byte_rows(rng, rows: int, cols: int) -> np.ndarray:
    """Rows of random bytes but for d and dmin (finite f16s of a weight's size): every scale, min and nibble."""
    blocks = rng.integers(0, 256, (rows, cols // 256, Q4_K_BLOCK), dtype=np.uint8)
    blocks[:, :, :4] = (rng.standard_normal((rows, cols // 256, 2)) * 0.01).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _quantized_rows(rng, rows: int, cols: int) -> np.ndarray:
    return ggml_base.load().quantize(rng.standard_normal((rows, cols)).astype(np.float32), Q.Q4_K)


@pytest.mark.parametrize("cols", [256, 1536, 8960])
@pytest.mark.parametrize("make_rows", [_random_byte_rows, _quantized_rows])
def test_our_q4_k_vec_dot_gives_ggmls_sums(make_rows, cols):
    rng = np.random.default_rng(cols)
    theirs, ours = _routines()
    rows = make_rows(rng, 24, cols)
    x = rng.standard_normal(cols).astype(np.float32) * 3
    reference = QuantMatrix(Q.Q4_K, rows)
    magnitude = np.abs(reference.dequantize_rows() * x).sum(axis=1)  # what float32 order errors scale with
    for i, row in enumerate(rows):
        got, expected = ours.dot(row, x), theirs.dot(row, x)
        assert abs(got - expected) <= 1e-5 * magnitude[i], (i, got, expected)
    exact = reference.dequantize_rows() @ x  # float32 rows, float32 x: what q8_K's rounding of x departs from
    got = np.array([ours.dot(row, x) for row in rows])
    assert np.all(np.abs(got - exact) <= 1e-2 * magnitude)


def test_the_largest_weights_and_inputs_do_not_saturate():
    """Every nibble 15, every six-bit scale and min 63, x at its largest (q8_K's 127 everywhere, and -128 where
    ggml rounds a negative maximum): the int16 pair sums and int32 lanes hold them exactly."""
    theirs, ours = _routines()
    blocks = np.full((2, 6, Q4_K_BLOCK), 0xFF, dtype=np.uint8)
    blocks[:, :, :4] = np.array([0.5, 0.25], dtype=np.float16).view(np.uint8)
    rows = blocks.reshape(2, -1)
    exact_rows = QuantMatrix(Q.Q4_K, rows).dequantize_rows()
    for x in (np.full(1536, 7.0, np.float32), np.full(1536, -7.0, np.float32)):
        for row, exact in zip(rows, exact_rows):
            got = ours.dot(row, x)
            assert got == pytest.approx(theirs.dot(row, x), rel=1e-6)
            assert got == pytest.approx(float(exact.astype(np.float64) @ x), rel=1e-2)


def test_the_runtime_takes_it_for_q4_k_rows_alone():
    """Chosen once, at load: ``kernels`` hands q4_K's address to every caller (the compiled decoder's ``fns`` table,
    ``kernels.matvec``), checked as ggml's are, and keeps ggml's for the other types."""
    from powerinfer_tools.kernels import ggml_ops

    ggml, loaded = ggml_ops.load(), kernels.ggml_routines()
    assert loaded.vec_dots_of_ours == {Q.Q4_K}
    assert loaded.routines[Q.Q4_K].vec_dot == numba_kquants.vec_dot_addresses()[int(Q.Q4_K)]
    assert all(loaded.routines[q].vec_dot == ggml.routines[q].vec_dot for q in ggml.routines if q != Q.Q4_K)
    assert "vec_dot of ours for q4_k" in kernels.describe()
    rng = np.random.default_rng(3)
    matrix = QuantMatrix(Q.Q4_K, _quantized_rows(rng, 40, 512))
    x = rng.standard_normal((1, 512)).astype(np.float32)
    np.testing.assert_allclose(kernels.matvec(matrix, x), matrix.matmul(x), rtol=0, atol=2e-2 * np.abs(x).sum())


def test_a_vec_dot_that_computes_wrong_is_refused_at_load():
    """``with_vec_dots`` checks a replacement as ggml's routines are checked: q4_0's vec_dot given for q4_K."""
    from powerinfer_tools.kernels import ggml_ops

    ggml = ggml_ops.load()
    with pytest.raises(ggml_ops.GgmlUnavailable, match="Q4_K vec_dot gave"):
        ggml.with_vec_dots({int(Q.Q4_K): ggml.routines[Q.Q4_0].vec_dot}, "a test")
