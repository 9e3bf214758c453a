"""Compiled CPU kernels against the NumPy reference (``QuantMatrix.matmul`` / ``weighted_row_sum``).

The compiled path must be present: CI installs llama-cpp-python and numba. Set
PITOOLS_ALLOW_NUMPY_KERNELS=1 to run on a machine without them; the kernel tests are then skipped
with the reason shown, and only the fallback tests run.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from powerinfer_tools import kernels
from powerinfer_tools.formats.weight_types import WEIGHT_TYPES, Kernel, WeightType
from powerinfer_tools.kernels import ggml_base, ggml_ops
from powerinfer_tools.kernels.quant import QuantMatrix
from powerinfer_tools.runtime import backends
from powerinfer_tools.runtime.backends import CpuBackend

TYPES = [t.qtype for t in WEIGHT_TYPES.values() if t.has(Kernel.AXPY)]  # f32, f16, q8_0, q4_0
GGML_TYPES = [t.qtype for t in WEIGHT_TYPES.values() if not t.has(Kernel.AXPY)]  # computed by ggml's routines
SHAPES = [(1, 32), (7, 64), (33, 96), (130, 2048)]  # one block wide; 3 blocks for 2 threads; a model row


@pytest.fixture(scope="module")
def compiled():
    if not kernels.available():
        reason = f"compiled kernels unavailable: {kernels.unavailable_reason()}"
        if os.environ.get("PITOOLS_ALLOW_NUMPY_KERNELS") != "1":
            pytest.fail(reason + " (set PITOOLS_ALLOW_NUMPY_KERNELS=1 to accept the NumPy fallback)")
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def restore_threads():
    before = kernels.get_threads()
    yield
    kernels.set_threads(before)


def make(qtype: Q, rows: int, cols: int, seed: int = 0) -> QuantMatrix:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    data = {Q.F32: w, Q.F16: w.astype(np.float16)}.get(qtype)
    if data is None:  # gguf-py has no quantizer of the k-quants: llama-quantize's
        data = quantize(w, qtype) if qtype in TYPES else ggml_base.load().quantize(w, qtype)
    data.setflags(write=False)  # GGUF weights are read-only memory maps
    return QuantMatrix(qtype, data)


def row_selections(n: int, rng) -> dict:
    return {
        "all": None,
        "none": np.array([], dtype=np.int64),
        "one": np.array([n - 1]),
        "sorted": np.sort(rng.choice(n, max(1, n // 3), replace=False)),
        "unsorted": rng.permutation(n)[: max(1, (2 * n) // 3) | 1],  # an odd count: uneven thread shares
        "int32 with repeats": rng.integers(0, n, size=5).astype(np.int32),
    }


def magnitudes(m: QuantMatrix, rows) -> np.ndarray:
    """|W[rows]| as float32 (dequantize_rows cannot reshape an empty selection of blocks)."""
    if rows is not None and len(rows) == 0:
        return np.zeros((0, m.cols), np.float32)
    return np.abs(m.dequantize_rows(rows))


def assert_matvec_close(m: QuantMatrix, x, rows, got):
    """Two checks. Against the reference on x as vec_dot sees it (encoded as q8_0 for quantized
    weights, as f16 for f16 weights: numpy emulates both exactly), up to float32 summation order;
    and against the reference on x itself, within the worst case of that encoding: a q8_0 element is
    off by at most half a step (1/254 of its block's largest magnitude) plus the f16 rounding of the
    block scale (127 steps of 2^-11 relative), an f16 element by 2^-11 relative."""
    w = magnitudes(m, rows)
    ax = np.abs(x)
    if m.qtype in (Q.Q8_0, Q.Q4_0):
        seen = dequantize(quantize(x, Q.Q8_0), Q.Q8_0)
        block_max = ax.reshape(len(x), -1, 32).max(axis=2).repeat(32, axis=1)
        encoding_bound = block_max @ w.T * (1 / 254 + 2.0**-11)
    elif m.qtype is Q.F16:
        seen = x.astype(np.float16).astype(np.float32)
        encoding_bound = ax @ w.T * 2.0**-11
    else:
        seen, encoding_bound = x, 0
    summation_bound = (np.abs(seen) + ax) @ w.T * 1e-5 + 1e-6
    assert got.shape == (len(x), w.shape[0]) and got.dtype == np.float32
    excess = np.abs(got - m.matmul(seen, rows)) - summation_bound
    assert (excess <= 0).all(), f"off by {excess.max():.3g} from the product with encoded x"
    excess = np.abs(got - m.matmul(x, rows)) - (encoding_bound + summation_bound)
    assert (excess <= 0).all(), f"off by {excess.max():.3g} beyond the encoding's rounding bound"


def assert_axpy_close(m: QuantMatrix, coeffs, rows, got):
    """The reference up to float32 summation order: 1e-5 of the sum of magnitudes."""
    expected = m.weighted_row_sum(coeffs, rows)
    bound = np.abs(coeffs) @ magnitudes(m, rows) * 1e-5 + 1e-6
    assert got.shape == expected.shape and got.dtype == np.float32
    excess = np.abs(got - expected) - bound
    assert (excess <= 0).all(), f"off by {excess.max():.3g} beyond 1e-5 relative"


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("threads", [1, 2, 3])  # 3: more than numba has on a 2-core machine
def test_kernels_match_reference(qtype, shape, tokens, threads):
    kernels.set_threads(threads)
    m = make(qtype, *shape)
    rng = np.random.default_rng([*shape, tokens])
    x = rng.standard_normal((tokens, m.cols)).astype(np.float32)
    for name, rows in row_selections(m.rows, rng).items():
        k = m.rows if rows is None else len(rows)
        coeffs = rng.standard_normal((tokens, k)).astype(np.float32)
        try:
            assert_matvec_close(m, x, rows, kernels.matvec(m, x, rows))
            assert_axpy_close(m, coeffs, rows, kernels.row_axpy(m, coeffs, rows))
        except AssertionError as exc:
            raise AssertionError(f"rows {name}: {exc}") from exc


def block_max(a: np.ndarray, block: int) -> np.ndarray:
    """|a| replaced, block by block along its rows, by the block's largest magnitude."""
    return np.abs(a).reshape(len(a), a.shape[1] // block, block).max(axis=2).repeat(block, axis=1)


@pytest.mark.usefixtures("compiled")
def test_rows_in_order_are_told_from_scattered_ones():
    from powerinfer_tools.kernels.numba_kernels import in_order

    assert in_order(np.arange(5, 5 + 300))  # all of a matrix, or one run of it: prefetch hints into L1
    assert in_order(np.array([], dtype=np.int64))
    assert not in_order(np.array([3, 9, 10, 40]))  # a sparse FFN's chosen rows: into L2
    assert not in_order(np.array([0, 1, 2, 4]))


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("qtype", GGML_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(7, 256), (130, 2048)], ids=str)  # one k-quant super-block; a model row
@pytest.mark.parametrize("tokens", [1, 3, kernels.MAX_TOKENS + 8])  # decoding; a prompt's block products
def test_types_computed_by_ggml_match_gguf_in_float64(qtype, shape, tokens):
    """The CPU backend's products over rows of a type without kernels of ours (``vec_dot`` on x encoded as
    the type's ``vec_dot_type`` up to ``MAX_TOKENS`` tokens, else rows from ggml's ``to_float`` times BLAS;
    the axpy always from ``to_float``) against gguf's dequantization multiplied in float64.

    The bound of a ``vec_dot`` product is x's encoding: each value within half a step of its block's scale
    (max/127: 1/254 of the block's largest |x|; q8_0 and q8_1 blocks of 32, q8_K of 256), the scale's f16
    rounding (q8_0, q8_1: up to 127 steps of 2^-11 relative), and q8_1's f16 block sum, which q4_1/q5_1
    multiply by their block minimum (|min| <= the block's largest |w|: 2^-11 of |x| times that); then
    1e-5 relative for float32 summation, which is all a ``to_float`` product may differ by. A block on a CPU
    with AVX-512 BF16 takes bfloat16 products instead (``kernels.bf16_matmul``): 2^-8 of each product."""
    backend = CpuBackend()
    m = make(qtype, *shape, seed=21)
    w = dequantize(np.asarray(m.data), qtype).astype(np.float64)
    rng = np.random.default_rng([*shape, tokens])
    x = (rng.standard_normal((tokens, m.cols)) * rng.uniform(0.1, 10, (tokens, 1))).astype(np.float32)
    partner_block = GGML_QUANT_SIZES[WEIGHT_TYPES[qtype].vec_dot_type][0]
    for name, rows in row_selections(m.rows, rng).items():
        picked = w if rows is None else w[rows]
        summation = np.abs(x) @ np.abs(picked).T * 1e-5 + 1e-6
        if tokens <= kernels.MAX_TOKENS:
            encoding = (block_max(x, partner_block) @ np.abs(picked).T * (1 / 254 + 2.0**-11)
                        + np.abs(x) @ block_max(picked, 32).T * 2.0**-11)
        else:
            encoding = np.abs(x) @ np.abs(picked).T * 2.0**-8 if kernels.bf16_matmuls(m) else 0
        excess = np.abs(backend.matmul(m, x, rows) - x.astype(np.float64) @ picked.T) - (encoding + summation)
        assert (excess <= 0).all(), f"rows {name}: matmul off by {excess.max():.3g} beyond its bound"
        coeffs = rng.standard_normal((tokens, len(picked))).astype(np.float32)
        bound = np.abs(coeffs) @ np.abs(picked) * 1e-5 + 1e-6
        excess = np.abs(backend.row_sum(m, coeffs, rows) - coeffs.astype(np.float64) @ picked) - bound
        assert (excess <= 0).all(), f"rows {name}: row_sum off by {excess.max():.3g} beyond 1e-5 relative"


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("cols", [8, 16, 64])
def test_narrow_f16_rows_dot_float32_x(cols):
    """``f16_row_dot`` (a predictor's narrow second layer): f16 weights, x rounded to f16 as ggml's f16
    ``vec_dot`` takes it, within float32 summation order of float64 NumPy; extreme f16 values included."""
    from numba import njit

    from powerinfer_tools.kernels.numba_kernels import f16_row_dot

    @njit
    def products(w, x, out):
        for i in range(w.shape[0]):
            out[i] = f16_row_dot(w.ctypes.data + i * w.strides[0], x.ctypes.data, x.shape[0])

    rng = np.random.default_rng(cols)
    w = rng.standard_normal((50, cols)).astype(np.float16)
    w[0], w[1] = 65504, -6e-8  # the largest f16, a subnormal
    x = rng.standard_normal(cols).astype(np.float32)
    out = np.empty(50, np.float32)
    products(w.view(np.uint8), x, out)  # as the runtime passes weights: their bytes
    seen = x.astype(np.float16).astype(np.float64)
    want = w.astype(np.float64) @ seen
    assert np.all(np.abs(out - want) <= 1e-6 * (np.abs(w.astype(np.float64)) @ np.abs(seen)) + 1e-30)


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_one_token_axpy_with_threads_sharing_rows_matches_reference(qtype, shape, threads):
    from powerinfer_tools.kernels.numba_kernels import axpy_rows_one_token

    m = make(qtype, *shape)
    rng = np.random.default_rng([*shape, threads])
    for name, rows in row_selections(m.rows, rng).items():
        rows = np.arange(m.rows) if rows is None else rows
        coeffs = rng.standard_normal((1, len(rows))).astype(np.float32)
        start = rng.standard_normal((1, m.cols)).astype(np.float32)
        out = start.copy()  # it adds to what is there, as the decoder's residual
        axpy_rows_one_token(int(m.qtype), kernels.weight_bytes(m), rows.astype(np.intp), coeffs, out, threads)
        again = start.copy()
        axpy_rows_one_token(int(m.qtype), kernels.weight_bytes(m), rows.astype(np.intp), coeffs, again, threads)
        assert np.array_equal(out, again), f"rows {name}: not deterministic"
        try:
            assert_axpy_close(m, coeffs, rows, out - start)
        except AssertionError as exc:
            raise AssertionError(f"rows {name}: {exc}") from exc


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("parts", [[(0, 5), (5, 40), (40, 41), (41, 97)], [(i, i + 1) for i in range(97)]],
                         ids=["ranges", "row-by-row"])
def test_one_token_axpy_in_consecutive_parts_sums_exactly_as_whole(qtype, threads, parts):
    """A neuron cache streams a step's rows in ranges (``runtime.neuron_cache.stream_in_order``): the parts'
    partial sums must end bit for bit where the whole product does. Row by row, this is also the check that
    the kernel's passes over several rows at once add them in order, as one at a time does."""
    from powerinfer_tools.kernels.numba_kernels import (add_partials, axpy_rows_one_token, axpy_rows_one_token_part,
                                                         row_partials)

    m = make(qtype, 301, 256, seed=5)
    rng = np.random.default_rng([threads, 6])
    rows = np.sort(rng.choice(m.rows, 97, replace=False)).astype(np.intp)
    coeffs = rng.standard_normal((1, len(rows))).astype(np.float32)
    start = rng.standard_normal((1, m.cols)).astype(np.float32)
    whole, parted = start.copy(), start.copy()
    axpy_rows_one_token(int(m.qtype), kernels.weight_bytes(m), rows, coeffs, whole, threads)
    partial = row_partials(len(rows), 1, m.cols, threads)
    for first, stop in parts:  # parts that cut the threads' runs (and the kernel's groups of rows) anywhere
        part_coeffs = np.ascontiguousarray(coeffs[:, first:stop])
        axpy_rows_one_token_part(int(m.qtype), kernels.weight_bytes(m), rows[first:stop], part_coeffs, partial,
                                 first, len(rows))
    add_partials(partial, parted)
    assert np.array_equal(whole, parted)


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n_tokens", [2, 5, 32])
def test_an_axpy_of_several_tokens_sums_each_as_its_own(qtype, n_tokens):
    """``axpy_rows`` decodes each row once for all the tokens (a batch's sequences, a short prompt): each token's
    sum must be bit for bit the one-token kernel's (the decoder's), rows and threads' partials added in the same
    order."""
    from powerinfer_tools.kernels.numba_kernels import axpy_rows, axpy_rows_one_token

    m = make(qtype, 301, 256, seed=7)
    rng = np.random.default_rng(n_tokens)
    rows = np.sort(rng.choice(m.rows, 99, replace=False)).astype(np.intp)
    coeffs = rng.standard_normal((n_tokens, len(rows))).astype(np.float32)
    together = rng.standard_normal((n_tokens, m.cols)).astype(np.float32)
    apart = together.copy()
    axpy_rows(int(m.qtype), kernels.weight_bytes(m), rows, coeffs, together, 2)
    for t in range(n_tokens):
        axpy_rows_one_token(int(m.qtype), kernels.weight_bytes(m), rows, coeffs[t : t + 1], apart[t : t + 1], 2)
    assert np.array_equal(together, apart)


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_thread_count_changes_no_product_beyond_rounding(qtype):
    # each output of matvec is computed by one thread in a fixed order, so it is bit-identical; row_axpy's threads
    # each sum a run of the rows, so the thread count changes the order of the additions alone
    m = make(qtype, 301, 256, seed=3)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    rows = rng.permutation(301)[:101]
    coeffs = rng.standard_normal((2, 101)).astype(np.float32)
    results = []
    for threads in (1, 2):
        kernels.set_threads(threads)
        results.append((kernels.matvec(m, x, rows), kernels.row_axpy(m, coeffs, rows)))
    assert np.array_equal(results[0][0], results[1][0])
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-5, atol=1e-5 * np.abs(results[0][1]).max())


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("threads", [1, 2])
def test_each_token_adds_just_the_rows_it_selected(qtype, threads):
    # A prompt's down projection reads each row once for the tokens that selected it; every token's
    # sum must be the one a decoded token computes with its own rows on one thread (the same arithmetic, bit for
    # bit: more threads each sum a run of a decoded token's rows)
    from powerinfer_tools.kernels.numba_kernels import axpy_rows_one_token, axpy_selected

    kernels.set_threads(threads)
    m = make(qtype, 120, 96, seed=12)
    rng = np.random.default_rng(13)
    rows = rng.permutation(120)[:50]
    mask = rng.random((9, 50)) < 0.3
    mask[4] = False  # a token that selected nothing gets nothing
    coeffs = np.where(mask, rng.standard_normal(mask.shape), 0).astype(np.float32)
    neuron, token = np.nonzero(mask.T)
    starts = np.concatenate([[0], np.cumsum(np.bincount(neuron, minlength=50))]).astype(np.intp)
    out = np.zeros((9, 96), np.float32)
    axpy_selected(int(m.qtype), kernels.weight_bytes(m), rows.astype(np.intp), starts, token.astype(np.intp),
                  coeffs, out, threads)
    for t in range(9):
        own = np.flatnonzero(mask[t])
        expected = np.zeros((1, 96), np.float32)
        axpy_rows_one_token(int(m.qtype), kernels.weight_bytes(m), rows[own].astype(np.intp),
                            np.ascontiguousarray(coeffs[t : t + 1, own]), expected, 1)
        expected = expected[0]
        assert np.array_equal(out[t], expected), f"token {t}"
        assert_axpy_close(m, coeffs[t : t + 1, own], rows[own], out[t : t + 1])


@pytest.mark.usefixtures("compiled")
def test_the_checks_catch_wrong_results():
    m = make(Q.Q4_0, 40, 128, seed=6)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, 128)).astype(np.float32)
    rows = np.arange(1, 21)
    with pytest.raises(AssertionError):  # products with the neighbouring rows
        assert_matvec_close(m, x, rows, kernels.matvec(m, x, rows - 1))
    with pytest.raises(AssertionError):  # every product 0.1% off, as from a slightly wrong scale
        assert_matvec_close(m, x, rows, kernels.matvec(m, x, rows) * np.float32(1.001))
    coeffs = rng.standard_normal((1, 20)).astype(np.float32)
    good = kernels.row_axpy(m, coeffs, rows)
    assert_axpy_close(m, coeffs, rows, good)
    bad = good.copy()
    bad[0, 77] *= 1 + 1e-3
    with pytest.raises(AssertionError):
        assert_axpy_close(m, coeffs, rows, bad)


@pytest.mark.usefixtures("compiled")
def test_memory_mapped_and_writable_weights(tmp_path):
    m = make(Q.Q8_0, 64, 256, seed=8)
    path = tmp_path / "w.bin"
    m.data.tofile(path)
    x = np.random.default_rng(9).standard_normal((1, 256)).astype(np.float32)
    coeffs = np.ones((1, 64), np.float32)
    for data in (np.memmap(path, dtype=np.uint8, mode="r", shape=m.data.shape), m.data.copy()):
        other = QuantMatrix(Q.Q8_0, data)
        assert np.array_equal(kernels.matvec(other, x), kernels.matvec(m, x))
        assert np.array_equal(kernels.row_axpy(other, coeffs), kernels.row_axpy(m, coeffs))


@pytest.mark.usefixtures("compiled")
def test_f16_width_off_the_block_grid_takes_the_reference():
    m = make(Q.F16, 5, 40)
    x = np.random.default_rng(10).standard_normal((1, 40)).astype(np.float32)
    coeffs = np.ones((1, 5), np.float32)
    assert_matvec_close(m, x, None, kernels.matvec(m, x))
    assert np.array_equal(kernels.row_axpy(m, coeffs), m.weighted_row_sum(coeffs))


@pytest.mark.usefixtures("compiled")
def test_many_tokens_take_the_reference():
    m = make(Q.Q4_0, 16, 64)
    x = np.random.default_rng(11).standard_normal((kernels.MAX_TOKENS + 1, 64)).astype(np.float32)
    assert np.array_equal(kernels.matvec(m, x), m.matmul(x))


@pytest.mark.usefixtures("compiled")
def test_bad_inputs_are_refused_before_the_kernels_read_memory():
    m = make(Q.Q4_0, 16, 64)
    x = np.ones((1, 64), np.float32)
    with pytest.raises(IndexError):
        kernels.matvec(m, x, np.array([3, 16]))
    with pytest.raises(IndexError):
        kernels.row_axpy(m, np.ones((1, 1), np.float32), np.array([-1]))
    with pytest.raises(ValueError, match=r"\[T, 64\]"):
        kernels.matvec(m, np.ones((1, 32), np.float32))
    with pytest.raises(ValueError, match=r"\[T, 2\]"):
        kernels.row_axpy(m, np.ones((1, 3), np.float32), np.array([0, 1]))
    with pytest.raises(ValueError):
        kernels.set_threads(0)


@pytest.mark.usefixtures("compiled")
def test_describe_names_the_library_and_threads():
    kernels.set_threads(2)
    assert kernels.describe().startswith("compiled:") and "libggml-cpu" in kernels.describe()
    assert kernels.describe().endswith("2 threads")


@pytest.mark.usefixtures("compiled")
def test_abi_check_refuses_a_mismatched_routine():
    routines = ggml_ops.load().routines
    wrong = dataclasses.replace(routines[Q.Q4_0], vec_dot=routines[Q.Q8_0].vec_dot)
    with pytest.raises(ggml_ops.GgmlUnavailable, match="Q4_0 vec_dot gave"):
        ggml_ops._check_numerics(Q.Q4_0, wrong, "test")


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("qtype", list(ggml_base.load().to_float), ids=lambda q: q.name)
def test_the_to_float_check_compares_finite_values_and_refuses_a_wrong_one(qtype, monkeypatch):
    """``to_float`` is checked on random bytes: most of what they decode to must be finite numbers (a check of
    NaNs alone would pass anything, and vec_dot's check takes a finite row), and a dequantizer that differs in
    one value makes the library unavailable."""
    with np.errstate(all="ignore"):
        reference = WEIGHT_TYPES[qtype].dequantize(ggml_base.check_rows(qtype))
    assert np.isfinite(reference).mean() > 0.9 and np.abs(reference).max(where=np.isfinite(reference), initial=0) > 0
    assert np.isfinite(reference).all(axis=1).any()  # the row ggml_ops checks vec_dot on
    library, lib_dir, version = ggml_base._open()
    right = WeightType.dequantize

    def wrong(self, stored):
        values = right(self, stored)
        if self.qtype == qtype:
            values.flat[np.flatnonzero(np.isfinite(values))[0]] += 1
        return values

    monkeypatch.setattr(WeightType, "dequantize", wrong)
    with pytest.raises(ggml_base.GgmlUnavailable, match=f"{qtype.name} to_float differs"):
        ggml_base._checked(library, lib_dir, version)


def test_unavailable_kernels_fall_back_to_numpy_with_a_warning(monkeypatch):
    monkeypatch.setattr(kernels, "_backend", lambda: "no libggml-cpu here (test)")
    assert not kernels.available() and kernels.unavailable_reason() == "no libggml-cpu here (test)"
    assert kernels.describe() == "NumPy reference (no libggml-cpu here (test))"
    m = make(Q.Q4_0, 8, 64)
    x = np.ones((1, 64), np.float32)
    with pytest.warns(RuntimeWarning, match="no libggml-cpu here"):
        assert np.array_equal(kernels.matvec(m, x), m.matmul(x))
    coeffs = np.ones((1, 8), np.float32)
    assert np.array_equal(kernels.row_axpy(m, coeffs), m.weighted_row_sum(coeffs))


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("qtype", list(WEIGHT_TYPES), ids=lambda q: q.name)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_block_products_of_every_type_match_float64(qtype, threads, monkeypatch):
    """A prompt's products (``kernels.block_matmul`` / ``block_row_sum``: each thread's rows dequantized a chunk
    at a time, times OpenBLAS's sgemm on that thread) over every weight type, with more rows than one chunk per
    thread (the chunks' sums accumulate) and every row selection, within float32 summation order of gguf's
    dequantization multiplied in float64."""
    assert backends._OPENBLAS.sgemm, "NumPy's OpenBLAS has no ILP64 cblas_sgemm here: the path is not tested"
    monkeypatch.setattr(kernels, "_threads", threads)
    m = make(qtype, 1100, 256, seed=5)
    w = dequantize(np.asarray(m.data).view(np.uint8) if qtype == Q.F16 else np.asarray(m.data), qtype)
    w = w.astype(np.float64).reshape(m.rows, m.cols)
    rng = np.random.default_rng(threads)
    x = rng.standard_normal((kernels.MAX_TOKENS + 7, m.cols)).astype(np.float32)
    for name, rows in row_selections(m.rows, rng).items():
        picked = w if rows is None else w[rows]
        got = kernels.block_matmul(m, x, rows, backends._OPENBLAS.sgemm)
        bound = np.abs(x) @ np.abs(picked).T * 1e-5 + 1e-6
        assert (np.abs(got - x @ picked.T) <= bound).all(), f"rows {name}: block_matmul"
        coeffs = rng.standard_normal((len(x), len(picked))).astype(np.float32)
        got = kernels.block_row_sum(m, coeffs, rows, backends._OPENBLAS.sgemm)
        bound = np.abs(coeffs) @ np.abs(picked) * 1e-5 + 1e-6
        assert (np.abs(got - coeffs @ picked) <= bound).all(), f"rows {name}: block_row_sum"


@pytest.mark.usefixtures("compiled")
def test_prompt_products_without_openblas_sgemm_take_the_kernels_in_token_chunks(monkeypatch):
    """Where NumPy's BLAS is not an OpenBLAS with an ILP64 ``cblas_sgemm`` (another BLAS, another OS), a prompt's
    products take the one-token kernels ``MAX_TOKENS`` tokens at a time, and compute the same products."""
    monkeypatch.setattr(backends._OPENBLAS, "sgemm", 0)
    called = []
    monkeypatch.setattr(kernels, "block_matmul", lambda *a: called.append(a))
    monkeypatch.setattr(kernels, "block_row_sum", lambda *a: called.append(a))
    m = make(Q.Q4_K, 40, 256, seed=3)
    w = m.dequantize_rows().astype(np.float64)
    x = np.random.default_rng(4).standard_normal((kernels.MAX_TOKENS * 2 + 5, m.cols)).astype(np.float32)
    backend = CpuBackend()
    assert np.allclose(backend.matmul(m, x), x @ w.T, rtol=2e-2, atol=0.5)  # x encoded as q8_K by vec_dot
    coeffs = np.random.default_rng(5).standard_normal((len(x), m.rows)).astype(np.float32)
    assert np.allclose(backend.row_sum(m, coeffs), coeffs @ w, rtol=1e-4, atol=1e-3)
    assert not called
