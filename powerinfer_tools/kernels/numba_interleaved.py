"""Multi-threaded products over q4_0 matrices interleaved eight rows at a time (``kernels.interleaved``),
through ggml's ``gemv`` and ``gemm`` for that layout (``ggml_ops.InterleavedRoutines``), or for one
token with ``vnni`` through ``numba_vnni.interleaved_group`` (faster than ggml's gemv from memory).

The threads share a matrix's groups of eight rows, each one contiguous run, so that every thread
makes one call per matrix: ggml's routine then streams its groups with nothing in between.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from powerinfer_tools.formats.weight_types import Q4_0, Q8_0, WEIGHT_TYPES
from powerinfer_tools.kernels import numba_vnni
from powerinfer_tools.kernels.interleaved import PIECE, ROWS, SCALE_BYTES
from powerinfer_tools.kernels.numba_kernels import BLOCK, ggml_from_float, ggml_interleaved_product
from powerinfer_tools.kernels.numba_cache import prepare_cache

_Q8_0_BLOCK_BYTES = WEIGHT_TYPES[Q8_0].block_bytes  # x's encoding for the products
_Q4_0_BLOCK_BYTES = WEIGHT_TYPES[Q4_0].block_bytes
NO_GROUPS = np.zeros((0, 1), np.uint8)  # a matrix of no rows for ``gemv_fused``'s unused third, typed as the others
NO_GROUPS.flags.writeable = False


@njit(parallel=True, nogil=True, cache=True)
def interleave(rows, out):
    """``kernels.interleaved.interleave``'s layout, byte for byte, written from the q4_0 ``rows`` ``[n, row_bytes]``
    into ``out`` ``[n / 8, 8 * row_bytes]`` in one pass, in a fraction of the NumPy reshuffle's time on a TinyLlama
    gate (5632 x 2048), which takes nearly as long as ggml's GEMM of it over 128 tokens."""
    group_bytes = ROWS * _Q4_0_BLOCK_BYTES
    for g in prange(out.shape[0]):
        for k in range(rows.shape[1] // _Q4_0_BLOCK_BYTES):
            block, at = k * _Q4_0_BLOCK_BYTES, k * group_bytes
            for r in range(ROWS):
                for b in range(SCALE_BYTES):
                    out[g, at + SCALE_BYTES * r + b] = rows[g * ROWS + r, block + b]
            for piece in range(2 * ROWS):  # piece i: row i % 8's quant bytes 8 * (i // 8) .., nibbles XOR 8
                source = block + SCALE_BYTES + PIECE * (piece // ROWS)
                target = at + ROWS * SCALE_BYTES + PIECE * piece
                for b in range(PIECE):
                    out[g, target + b] = rows[g * ROWS + piece % ROWS, source + b] ^ 0x88


@njit(inline="always")
def _groups_gemv(gemv, packed, first, stop, x_encoded, cols, out, sums):
    """``out[g*8 : stop*8] = W · x`` for the groups ``first .. stop - 1`` of ``packed`` (nothing if empty):
    with ``numba_vnni`` where ``sums`` (its ``block_sums`` of x) is not empty, else with ggml's ``gemv``."""
    if stop <= first:
        return
    if sums.shape[0]:
        for g in range(first, stop):
            numba_vnni.interleaved_group(packed.ctypes.data + g * packed.strides[0], x_encoded.ctypes.data,
                                         sums.ctypes.data, cols // BLOCK, out.ctypes.data + g * ROWS * 4)
    else:
        ggml_interleaved_product(gemv, cols, out.ctypes.data + first * ROWS * 4, 0,
                                 packed.ctypes.data + first * packed.strides[0], x_encoded.ctypes.data, 1,
                                 (stop - first) * ROWS)


@njit(inline="always")
def _sums(x_encoded, cols, vnni):
    return numba_vnni.block_sums(x_encoded, cols // BLOCK if vnni else 0)


@njit(parallel=True, nogil=True, cache=True)
def gemv(fn, packed, x_encoded, cols, out, n_threads, vnni):
    """One token: ``out = W · x`` for ``x`` encoded as q8_0 in ``x_encoded``."""
    groups, sums = packed.shape[0], _sums(x_encoded, cols, vnni)
    n_chunks = max(1, min(n_threads, groups))
    for chunk in prange(n_chunks):
        _groups_gemv(fn, packed, chunk * groups // n_chunks, (chunk + 1) * groups // n_chunks, x_encoded, cols, out,
                     sums)


@njit(parallel=True, nogil=True, cache=True)
def gemv_fused(fn, a, b, c, x_encoded, cols, out_a, out_b, out_c, n_threads, vnni):
    """``out_a, out_b, out_c = A·x, B·x, C·x`` (q, k, v; or gate, up and a ``c`` of no groups) in one
    parallel loop: the threads share the three matrices' groups as one run (a share may span two)."""
    na, nb = a.shape[0], b.shape[0]
    total, sums = na + nb + c.shape[0], _sums(x_encoded, cols, vnni)
    n_chunks = max(1, min(n_threads, total))
    for chunk in prange(n_chunks):
        first, stop = chunk * total // n_chunks, (chunk + 1) * total // n_chunks
        _groups_gemv(fn, a, min(first, na), min(stop, na), x_encoded, cols, out_a, sums)
        _groups_gemv(fn, b, min(max(first - na, 0), nb), min(max(stop - na, 0), nb), x_encoded, cols, out_b, sums)
        _groups_gemv(fn, c, max(first - na - nb, 0), max(stop - na - nb, 0), x_encoded, cols, out_c, sums)


@njit(parallel=True, nogil=True, cache=True)
def gemm(gemm_fn, gemv_fn, quantize4, from_float, packed, x, x_encoded, out, n_threads):
    """``out[t] = W · x[t]`` for every token of ``x [T, cols]`` (float32, contiguous) into ``out [T, rows]``.
    Tokens go four at a time through ``gemm`` (x quantized by ``quantize4``), the ``T % 4`` left through
    ``gemv``; ``x_encoded`` holds ``T`` q8_0 rows of scratch."""
    n_tokens, cols = x.shape
    row_q8 = cols // BLOCK * _Q8_0_BLOCK_BYTES
    in_fours = n_tokens - n_tokens % 4
    xe = x_encoded.ctypes.data
    for f in prange(in_fours // 4):
        ggml_from_float(quantize4, x[4 * f].ctypes.data, xe + 4 * f * row_q8, cols)
    for t in range(in_fours, n_tokens):
        ggml_from_float(from_float, x[t].ctypes.data, xe + t * row_q8, cols)
    groups, rows = packed.shape[0], out.shape[1]
    n_chunks = max(1, min(n_threads, groups))
    for chunk in prange(n_chunks):
        first, stop = chunk * groups // n_chunks, (chunk + 1) * groups // n_chunks
        if stop > first:
            w, s = packed.ctypes.data + first * packed.strides[0], out.ctypes.data + first * ROWS * 4
            if in_fours:
                ggml_interleaved_product(gemm_fn, cols, s, rows, w, xe, in_fours, (stop - first) * ROWS)
            for t in range(in_fours, n_tokens):
                ggml_interleaved_product(gemv_fn, cols, s + t * rows * 4, 0, w, xe + t * row_q8, 1,
                                         (stop - first) * ROWS)


prepare_cache(globals())  # stale machine code flushed, the rest loaded without the compiler (kernels.numba_cache)
