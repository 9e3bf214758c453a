"""Products for a block of tokens (a prompt) over a matrix that has no GEMM of its own here (k-quants, f16, f32,
and the rows of ``ffn_down_t``): each thread of the compiled kernels dequantizes its share of the rows a chunk at a
time (ggml's ``to_float``) and multiplies the chunk with OpenBLAS's ``sgemm`` on that same thread.

The work runs on numba's threads rather than a pool of Python threads because numba's OpenMP workers, after each
parallel region, spin on their cores waiting for the next one: on two cores a Python pool doing this same work
right after a compiled product (a prompt's up, then its down) ran far slower than alone (SmolLM2's ``ffn_down_t``
times 128 tokens). On numba's threads a 128-token prompt's down projections take less time
than on such a pool, on Gemma 3 270M's and SmolLM2's CATS files alike.

``sgemm`` is the address of OpenBLAS's ILP64 ``cblas_sgemm`` (``runtime.backends``), which the caller keeps
single-threaded while these run: each thread's call computes on that thread.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from powerinfer_tools.kernels.numba_kernels import ggml_from_float
from powerinfer_tools.kernels.numba_cache import prepare_cache

# CBLAS's enums (cblas.h)
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_I32, _I64, _F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
_PTR = ir.IntType(8).as_pointer()

# ggml's ``to_float(const void *x, float *y, int64_t k)`` has the signature of its ``from_float``: one call serves both
ggml_to_float = ggml_from_float


@intrinsic
def cblas_sgemm(typingctx, fn, trans_b, m, n, k, a, lda, b, ldb, beta, c, ldc):
    """Call ``cblas_sgemm(RowMajor, NoTrans, trans_b, m, n, k, 1, a, lda, b, ldb, beta, c, ldc)`` at address ``fn``
    (ILP64: 64-bit sizes): ``C = A·op(B) + beta·C``."""
    sig = types.void(*[types.intp] * 9, types.float32, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        fn_addr, trans, m_, n_, k_, a_addr, lda_, b_addr, ldb_, beta_, c_addr, ldc_ = args
        fnty = ir.FunctionType(ir.VoidType(), [_I32, _I32, _I32, _I64, _I64, _I64, _F32, _PTR, _I64, _PTR, _I64, _F32,
                                               _PTR, _I64])
        callee = builder.inttoptr(fn_addr, fnty.as_pointer())
        builder.call(callee, [
            ir.Constant(_I32, _ROW_MAJOR), ir.Constant(_I32, _NO_TRANS), builder.trunc(trans, _I32), m_, n_, k_,
            ir.Constant(_F32, 1.0), builder.inttoptr(a_addr, _PTR), lda_, builder.inttoptr(b_addr, _PTR), ldb_, beta_,
            builder.inttoptr(c_addr, _PTR), ldc_,
        ])
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always")
def dequantize_rows(to_float, weights, rows, first, stop, buffer):
    """``buffer[: stop - first]`` = rows ``rows[first:stop]`` of ``weights`` as float32: ``to_float``, or the bytes
    themselves where it is 0 (f32 rows)."""
    cols = buffer.shape[1]
    for i in range(first, stop):
        if to_float:
            ggml_to_float(to_float, weights[rows[i]].ctypes.data, buffer[i - first].ctypes.data, cols)
        else:  # an explicit loop: numba's parallel lowering loses a slice assignment into a view
            source, target = weights[rows[i]], buffer[i - first].view(np.uint8)
            for j in range(source.shape[0]):
                target[j] = source[j]


@njit(inline="always")
def share(n, thread, n_threads):
    """Thread ``thread``'s contiguous share ``[first, stop)`` of ``n`` items."""
    return thread * n // n_threads, (thread + 1) * n // n_threads


@njit(parallel=True, nogil=True, cache=True)
def products(to_float, sgemm, weights, rows, a, buffers, out, sums):
    """With ``sums`` false, ``out [T, len(rows)] = a [T, cols] @ W[rows].T``; with it, ``out[w] = a[:, share] @
    W[rows[share]]`` for each thread ``w``'s share of the rows (``out`` zeroed ``[threads, T, cols]``: the caller
    adds them up). ``buffers [threads, chunk, cols]`` float32: a thread dequantizes its share ``chunk`` rows at a
    time into its own."""
    n, chunk, cols = rows.shape[0], buffers.shape[1], buffers.shape[2]
    tokens, lda = a.shape[0], a.strides[0] // 4
    for thread in prange(buffers.shape[0]):
        first, stop = share(n, thread, buffers.shape[0])
        b = buffers[thread].ctypes.data
        for start in range(first, stop, chunk):
            end = min(start + chunk, stop)
            dequantize_rows(to_float, weights, rows, start, end, buffers[thread])
            if sums:  # out[thread] += a[:, start:end] @ these rows
                cblas_sgemm(sgemm, _NO_TRANS, tokens, cols, end - start, a.ctypes.data + 4 * start, lda, b, cols,
                            np.float32(1), out.ctypes.data + thread * out.strides[0], cols)
            else:  # out[:, start:end] = a @ these rows.T
                cblas_sgemm(sgemm, _TRANS, tokens, end - start, cols, a.ctypes.data, lda, b, cols, np.float32(0),
                            out.ctypes.data + 4 * start, out.strides[0] // 4)


prepare_cache(globals())  # stale machine code flushed, the rest loaded without the compiler (kernels.numba_cache)
