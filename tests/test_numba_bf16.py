"""A prompt's down projection over q4_0 rows in bfloat16 products (kernels/numba_bf16.py): exact where every
value is a bfloat16, within the two roundings' bound elsewhere, on any CPU (the plain-IR spelling where AVX-512
BF16 is missing), and what the runtime takes for a block of tokens where the CPU has it."""

from __future__ import annotations

import os
import subprocess
import sys

import llvmlite.binding
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from powerinfer_tools import kernels
from powerinfer_tools.kernels import ggml_base, numba_bf16
from powerinfer_tools.kernels import numba_kernels as nk
from powerinfer_tools.kernels.quant import QuantMatrix
from powerinfer_tools.runtime.backends import CpuBackend

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the compiled kernels are unavailable")


def row_sum(weights: np.ndarray, rows: np.ndarray, coeffs: np.ndarray, threads: int) -> np.ndarray:
    """``numba_bf16.row_sum`` with its scratch, on ``threads`` threads."""
    threads = nk.use_threads(threads)
    out = np.full((len(coeffs), weights.shape[1] // 18 * 32), np.nan, np.float32)
    numba_bf16.row_sum(weights, rows, coeffs, out, np.empty((threads, numba_bf16.slab_bytes(len(rows))), np.uint8),
                       np.empty((threads, numba_bf16.TOKENS, 32), np.float32))
    return out


def exact_case(seed: int, n_rows: int = 75, cols: int = 96):
    """q4_0 rows whose scales are powers of two and coefficients that are small integers: every value is a
    bfloat16 and every sum exact in float32, so any slip of a row, a column or a token shows."""
    rng = np.random.default_rng(seed)
    weights = quantize(rng.standard_normal((n_rows, cols)).astype(np.float32), Q.Q4_0).reshape(n_rows, -1, 18)
    scales = (2.0 ** rng.integers(-6, 3, (n_rows, cols // 32, 1))).astype(np.float16)
    weights[:, :, :2] = scales.view(np.uint8)
    weights = weights.reshape(n_rows, -1)
    return weights, dequantize(weights, Q.Q4_0).astype(np.float64), rng


SELECTIONS = {  # rows of 75: all; an odd count (a row pair padded); fewer than 32 with repeats; none
    "all": np.arange(75), "odd, unsorted": np.random.default_rng(1).permutation(75)[:41],
    "few, repeated": np.array([3, 3, 70, 0, 5]), "none": np.array([], dtype=np.int64),
}


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("name", list(SELECTIONS))
def test_sums_are_exact_where_every_value_is_a_bfloat16(name, threads):
    weights, w, rng = exact_case(seed=threads)
    rows = SELECTIONS[name].astype(np.intp)
    for tokens in (1, 8, 13):  # a tile's tokens, fewer, and a last tile part-filled
        coeffs = rng.integers(-4, 5, (tokens, len(rows))).astype(np.float32)
        assert np.array_equal(row_sum(weights, rows, coeffs, threads), coeffs @ w[rows]), f"{tokens} tokens"


def test_sums_stay_within_the_bound_of_the_two_roundings():
    """Each product errs by at most 2^-8 of its size (weight and coefficient each rounded to 8 significant
    bits), the float32 sums by far less."""
    rng = np.random.default_rng(7)
    weights = quantize(rng.standard_normal((300, 576)).astype(np.float32), Q.Q4_0)
    w = dequantize(weights, Q.Q4_0).astype(np.float64)
    coeffs = (rng.standard_normal((40, 300)) * np.exp(rng.uniform(-8, 8, (40, 1)))).astype(np.float32)
    got = row_sum(weights, np.arange(300, dtype=np.intp), coeffs, 2)
    bound = np.abs(coeffs) @ np.abs(w) * (2.0**-8 + 300 * 2.0**-24)
    assert (np.abs(got - coeffs @ w) <= bound).all()
    assert np.abs(got - coeffs @ w).max() > 0  # rounded: not the float32 sums themselves


def exact_rows(qtype: Q, seed: int, n_rows: int = 21, cols: int = 96) -> tuple[QuantMatrix, np.ndarray]:
    """Rows whose every weight is a bfloat16 (``exact_case``'s for q4_0 and q8_0; small integers times powers of
    two for f16 and f32), with their values in float64."""
    rng = np.random.default_rng(seed)
    if qtype is Q.Q4_0:
        weights, w, _ = exact_case(seed, n_rows, cols)
    elif qtype is Q.Q8_0:  # any int8 times a power of two is a bfloat16
        weights = quantize(rng.standard_normal((n_rows, cols)).astype(np.float32), Q.Q8_0).reshape(n_rows, -1, 34)
        scales = (2.0 ** rng.integers(-6, 3, (n_rows, cols // 32, 1))).astype(np.float16)
        weights[:, :, :2] = scales.view(np.uint8)
        weights = weights.reshape(n_rows, -1)
    else:
        w = rng.integers(-8, 8, (n_rows, cols)) * 2.0 ** rng.integers(-6, 3, (n_rows, 1))
        weights = w.astype(np.float16 if qtype is Q.F16 else np.float32)
    return QuantMatrix(qtype, weights), dequantize(np.asarray(weights).view(np.uint8) if qtype is Q.F16 else weights,
                                                   qtype).astype(np.float64).reshape(n_rows, cols)


@pytest.mark.skipif(not numba_bf16.available(), reason="this CPU lacks AVX-512 BF16: kernels.bf16_matmul is not used")
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.F16, Q.F32], ids=lambda q: q.name)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_matmul_is_exact_where_every_value_is_a_bfloat16(qtype, threads, monkeypatch):
    """``kernels.bf16_matmul`` (``numba_bf16.matmul``): 32 tokens to a slab, eight rows to a tile; the tokens
    and rows past the last of each are padding, and no row of a thread's share may go missing."""
    monkeypatch.setattr(kernels, "_threads", threads)
    m, w = exact_rows(qtype, seed=threads)
    rng = np.random.default_rng(threads)
    selections = {"all": None, "odd, unsorted": rng.permutation(21)[:13], "one": np.array([20]),
                  "none": np.array([], dtype=np.int64)}
    for name, rows in selections.items():
        picked = w if rows is None else w[rows]
        for tokens in (1, 13, 70):
            x = rng.integers(-4, 5, (tokens, m.cols)).astype(np.float32)
            assert np.array_equal(kernels.bf16_matmul(m, x, rows), x @ picked.T), f"{name}, {tokens} tokens"


_PLAIN_IR = """
import sys
import numpy as np
from powerinfer_tools.kernels import numba_bf16
sys.path.insert(0, sys.argv[1])
import test_numba_bf16 as t
assert not numba_bf16.available()
weights, w, rng = t.exact_case(seed=4)
rows = t.SELECTIONS["odd, unsorted"].astype(np.intp)
coeffs = rng.integers(-4, 5, (13, len(rows))).astype(np.float32)
assert np.array_equal(t.row_sum(weights, rows, coeffs, 2), coeffs @ w[rows])
from powerinfer_tools.kernels import numba_kernels as nk
m, w = t.exact_rows(t.Q.Q8_0, seed=5)
x = rng.integers(-4, 5, (40, m.cols)).astype(np.float32)
out, chunk = np.empty((40, m.rows), np.float32), numba_bf16.chunk_rows(m.cols)
threads = nk.use_threads(2)
numba_bf16.matmul(t.kernels._to_float(m), t.kernels.weight_bytes(m), np.arange(m.rows), x, out,
                  np.empty((threads, chunk, m.cols), np.float32), np.empty((threads, chunk, m.cols), np.uint16),
                  np.empty((threads, numba_bf16.TOKENS, 32), np.float32))
assert np.array_equal(out, x @ w.T)
"""


@pytest.mark.slow
def test_the_plain_ir_spelling_computes_the_same_sums(tmp_path):
    """Compiled for this CPU less AVX-512 BF16 (numba's cache kept apart), the kernel spells ``vdpbf16ps`` in
    plain vector IR and computes the same exact sums."""
    features = llvmlite.binding.get_host_cpu_features()
    features["avx512bf16"] = False
    env = dict(os.environ, NUMBA_CPU_NAME="host", NUMBA_CPU_FEATURES=features.flatten(),
               NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    run = subprocess.run([sys.executable, "-c", _PLAIN_IR, os.path.dirname(__file__)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.skipif(not numba_bf16.available(), reason="this CPU lacks AVX-512 BF16: prompts take BLAS")
def test_a_prompt_takes_it_for_q4_0_rows_and_blas_for_others(monkeypatch):
    """A block of tokens over q4_0 ``ffn_down_t`` takes ``bf16_row_sum`` (other types: dequantized for BLAS)."""
    weights, w, rng = exact_case(seed=9)
    coeffs = rng.integers(-4, 5, (kernels.MAX_TOKENS + 9, 75)).astype(np.float32)
    m = QuantMatrix(Q.Q4_0, weights)
    assert kernels.bf16_row_sums(m) and not kernels.bf16_row_sums(QuantMatrix(Q.F32, w.astype(np.float32)))
    taken, real = [], kernels.bf16_row_sum
    monkeypatch.setattr(kernels, "bf16_row_sum", lambda *a: taken.append(len(a[1])) or real(*a))
    backend = CpuBackend()
    backend.row_sum(m, coeffs[: kernels.MAX_TOKENS])  # a block within the one-token kernels' limit: theirs
    assert not taken
    assert np.array_equal(backend.row_sum(m, coeffs), coeffs @ w) and taken == [len(coeffs)]


@pytest.mark.skipif(not numba_bf16.available(), reason="this CPU lacks AVX-512 BF16: prompts take BLAS")
def test_a_prompt_multiplies_k_quant_rows_in_bfloat16(monkeypatch):
    """A block of tokens times a matrix with no GEMM here (q4_K) takes ``bf16_matmul``, within the two roundings'
    bound of float64; a block within the one-token kernels' limit takes theirs, and f16 rows (kept in floats for
    their precision) stay with BLAS."""
    rng = np.random.default_rng(11)
    m = QuantMatrix(Q.Q4_K, ggml_base.load().quantize(rng.standard_normal((40, 512)).astype(np.float32), Q.Q4_K))
    w = m.dequantize_rows().astype(np.float64)
    assert kernels.bf16_matmuls(m) and not kernels.bf16_matmuls(QuantMatrix(Q.F16, w.astype(np.float16)))
    taken, real = [], kernels.bf16_matmul
    monkeypatch.setattr(kernels, "bf16_matmul", lambda *a: taken.append(len(a[1])) or real(*a))
    backend = CpuBackend()
    x = rng.standard_normal((kernels.MAX_TOKENS + 9, m.cols)).astype(np.float32)
    backend.matmul(m, x[: kernels.MAX_TOKENS])
    assert not taken
    got = backend.matmul(m, x)
    assert taken == [len(x)]
    assert (np.abs(got - x @ w.T) <= np.abs(x) @ np.abs(w).T * (2.0**-8 + 512 * 2.0**-24)).all()
