"""Multi-threaded numba loops over the active rows of a weight matrix, reading it in place.

Two shapes of work, for the two halves of a sparse FFN; both take the weights as their raw bytes
(``[rows, row_bytes]`` uint8) and the weight type as its ggml id:

* ``dot_rows``: ``out[t, i] = W[rows[i]] · x[t]`` (gate/up, dense or gathered). Each product is one
  call to ggml's SIMD ``vec_dot``, whose address is passed in; threads split the rows.
* ``axpy_rows``: ``out[t] += Σ_j coeffs[t, j] · W[rows[j]]`` (the down projection, stored transposed
  as ``ffn_down_t``). Threads split the *output columns* into one contiguous share each, so a
  thread's slice of ``out`` stays in L1, nobody synchronises, and every active row is read as one
  contiguous stretch per thread. The work per 32-column block is one LLVM vector expression
  (``_block_axpy``): numba's own loops here stay scalar, because LLVM cannot prove that ``out`` and
  the weights do not overlap (one thread, weights in cache: 0.3-1 GB/s scalar, 7-20 GB/s vector).

Function addresses and thread counts are arguments rather than globals or in-kernel calls, so
``cache=True`` can keep the machine code on disk (a baked-in address would be stale in the next
process, and numba refuses to cache functions that read such "dynamic globals").
"""

from __future__ import annotations

import numpy as np
import numba
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

F16, Q4_0, Q8_0 = 1, 2, 8  # ggml type ids (gguf's GGMLQuantizationType values); F32 is 0
BLOCK = 32  # elements per q4_0/q8_0 block; axpy_rows also walks f32/f16 rows 32 at a time
# Both loops ask for the bytes of the active row PREFETCH_ROWS ahead: active rows are scattered, so
# the hardware prefetcher cannot guess the next one. Measured on the busy 2-core machine, 1 thread,
# q4_0 5632x2048 cycling through 260 MB of copies, median GB/s without -> with: 10% of rows 2.9 -> 8.4
# (matvec), 2.7 -> 5.9 (axpy); all rows 3.7-7.3 -> 8.7-10 (matvec). 1, 4 or 8 rows ahead, or
# prefetching to L2 only, did no better.
PREFETCH_ROWS = 2

_I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
_FLOAT = ir.FloatType()
_PTR = _I8.as_pointer()


def use_threads(n: int) -> int:
    """Run the next kernels from this Python thread on ``n`` threads (numba's setting is per calling
    thread, and capped by NUMBA_NUM_THREADS); returns the count actually used."""
    n = min(n, numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(n)
    return n


@intrinsic
def ggml_from_float(typingctx, fn, x, y, k):
    """Call ggml's ``void from_float(const float *x, void *y, int64_t k)`` at address ``fn``."""
    sig = types.void(types.intp, types.intp, types.intp, types.int64)

    def codegen(context, builder, signature, args):
        fn_addr, x_addr, y_addr, n = args
        fnty = ir.FunctionType(ir.VoidType(), [_PTR, _PTR, _I64])
        callee = builder.inttoptr(fn_addr, fnty.as_pointer())
        builder.call(callee, [builder.inttoptr(x_addr, _PTR), builder.inttoptr(y_addr, _PTR), n])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def ggml_vec_dot(typingctx, fn, n, s, x, y):
    """Call ggml's ``vec_dot(n, s, 0, x, 0, y, 0, 1)`` at address ``fn``: ``*s = x · y`` for one row."""
    sig = types.void(types.intp, types.intp, types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        fn_addr, n_, s_addr, x_addr, y_addr = args
        fnty = ir.FunctionType(ir.VoidType(), [_I32, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I32])
        callee = builder.inttoptr(fn_addr, fnty.as_pointer())
        zero = ir.Constant(_I64, 0)  # strides: unused for a single row (nrc = 1)
        builder.call(callee, [
            builder.trunc(n_, _I32), builder.inttoptr(s_addr, _PTR), zero, builder.inttoptr(x_addr, _PTR), zero,
            builder.inttoptr(y_addr, _PTR), zero, ir.Constant(_I32, 1),
        ])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def ggml_interleaved_product(typingctx, fn, n, s, bs, vx, vy, nr, nc):
    """Call ggml's ``gemv``/``gemm`` over interleaved q4_0 at ``fn`` (``ggml_ops._INTERLEAVED``):
    ``s[t * bs + i] = x_t · W_i`` for ``nr`` tokens and the ``nc`` rows at ``vx``."""
    sig = types.void(*[types.intp] * 8)

    def codegen(context, builder, signature, args):
        fn_addr, n_, s_addr, bs_, vx_addr, vy_addr, nr_, nc_ = args
        fnty = ir.FunctionType(ir.VoidType(), [_I32, _PTR, _I64, _PTR, _PTR, _I32, _I32])
        callee = builder.inttoptr(fn_addr, fnty.as_pointer())
        builder.call(callee, [
            builder.trunc(n_, _I32), builder.inttoptr(s_addr, _PTR), bs_, builder.inttoptr(vx_addr, _PTR),
            builder.inttoptr(vy_addr, _PTR), builder.trunc(nr_, _I32), builder.trunc(nc_, _I32),
        ])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _prefetch(typingctx, addr):
    """Hint the cache line at ``addr`` into all cache levels for reading (``llvm.prefetch``)."""
    sig = types.void(types.intp)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.VoidType(), [_PTR, _I32, _I32, _I32])
        prefetch = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        read, keep_in_all_levels, data_cache = (ir.Constant(_I32, v) for v in (0, 3, 1))
        builder.call(prefetch, [builder.inttoptr(args[0], _PTR), read, keep_in_all_levels, data_cache])
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always")
def prefetch_span(addr, nbytes):
    for offset in range(0, nbytes, 64):
        _prefetch(addr + offset)


@njit(parallel=True, nogil=True, cache=True)
def dot_rows(from_float, vec_dot, weights, rows, x, x_encoded, out):
    """``out[t, i] = weights[rows[i]] · x[t]``; ``x_encoded`` is scratch for x in vec_dot's encoding."""
    n_tokens, cols = x.shape
    for t in range(n_tokens):
        ggml_from_float(from_float, x[t].ctypes.data, x_encoded[t].ctypes.data, cols)
    w_addr, row_bytes = weights.ctypes.data, weights.strides[0]
    xe_addr, xe_stride = x_encoded.ctypes.data, x_encoded.strides[0]
    out_addr, out_stride = out.ctypes.data, out.strides[0]
    n_rows = rows.shape[0]
    for i in prange(n_rows):
        if i + PREFETCH_ROWS < n_rows:
            prefetch_span(w_addr + rows[i + PREFETCH_ROWS] * row_bytes, weights.shape[1])
        row_addr = w_addr + rows[i] * row_bytes
        for t in range(n_tokens):  # tokens innermost: the weight row comes from memory once
            ggml_vec_dot(vec_dot, cols, out_addr + t * out_stride + i * 4, row_addr, xe_addr + t * xe_stride)


# --- the axpy: one block of 32 weights, decoded once, added to every token's output --------------

def _load(builder, addr, ty):
    return builder.load(builder.inttoptr(addr, ty.as_pointer()), align=1)


def _splat(builder, value, n):
    vec = ir.VectorType(value.type, n)
    one = builder.insert_element(ir.Constant(vec, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined), ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _offset(builder, addr, n):
    return builder.add(addr, ir.Constant(addr.type, n))


def _scaled(builder, block, ints):
    """``ints`` (32 small integers) times the block's leading f16 scale, as 32 floats."""
    scale = builder.fpext(_load(builder, block, ir.HalfType()), _FLOAT)
    return builder.fmul(builder.sitofp(ints, ir.VectorType(_FLOAT, BLOCK)), _splat(builder, scale, BLOCK))


def _decode_q8_0(builder, block):  # f16 scale, then 32 int8
    return _scaled(builder, block, _load(builder, _offset(builder, block, 2), ir.VectorType(_I8, BLOCK)))


def _decode_q4_0(builder, block):  # f16 scale, then 16 bytes: low nibbles are elements 0-15, high 16-31
    vec16 = ir.VectorType(_I8, 16)
    packed = _load(builder, _offset(builder, block, 2), vec16)
    low = builder.and_(packed, ir.Constant(vec16, [0x0F] * 16))
    high = builder.lshr(packed, ir.Constant(vec16, [4] * 16))
    nibbles = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(_I32, BLOCK), list(range(BLOCK))))
    return _scaled(builder, block, builder.sub(nibbles, ir.Constant(ir.VectorType(_I8, BLOCK), [8] * BLOCK)))


def _decode_f16(builder, block):
    return builder.fpext(_load(builder, block, ir.VectorType(ir.HalfType(), BLOCK)), ir.VectorType(_FLOAT, BLOCK))


def _decode_f32(builder, block):
    return _load(builder, block, ir.VectorType(_FLOAT, BLOCK))


def _block_axpy(decode):
    """An intrinsic ``f(out, out_stride, block, coeffs, coeffs_stride, tokens, n_tokens)`` (addresses
    and byte strides) doing ``out[t][0:32] += coeffs[t] * decode(block)`` for ``n_tokens`` tokens t:
    the intp token ids stored at ``tokens``, or ``0 .. n_tokens-1`` where ``tokens`` is 0 (decoding's
    case, kept free of the list's loads). The block is decoded once for all of them."""

    @intrinsic
    def block_axpy(typingctx, out, out_stride, block, coeffs, coeffs_stride, tokens, n_tokens):
        sig = types.void(*[types.intp] * 7)

        def codegen(context, builder, signature, args):
            out_, out_stride_, block_, coeffs_, coeffs_stride_, tokens_, n_tokens_ = args
            values = decode(builder, block_)

            def add_to_each(token_of):
                with cgutils.for_range(builder, n_tokens_) as loop:
                    token = token_of(loop.index)
                    coeff = _load(builder, builder.add(coeffs_, builder.mul(token, coeffs_stride_)), _FLOAT)
                    target = builder.inttoptr(builder.add(out_, builder.mul(token, out_stride_)),
                                              ir.VectorType(_FLOAT, BLOCK).as_pointer())
                    product = builder.fmul(values, _splat(builder, coeff, BLOCK), flags=("contract",))
                    total = builder.fadd(builder.load(target, align=4), product, flags=("contract",))
                    builder.store(total, target, align=4)

            listed = builder.icmp_unsigned("!=", tokens_, ir.Constant(tokens_.type, 0))
            with builder.if_else(listed) as (from_list, in_order):
                with from_list:
                    add_to_each(lambda i: _load(builder, builder.add(tokens_, builder.mul(i, ir.Constant(_I64, 8))),
                                                _I64))
                with in_order:
                    add_to_each(lambda i: i)
            return context.get_dummy_value()

        return sig, codegen

    return block_axpy


_axpy_q8_0 = _block_axpy(_decode_q8_0)
_axpy_q4_0 = _block_axpy(_decode_q4_0)
_axpy_f16 = _block_axpy(_decode_f16)
_axpy_f32 = _block_axpy(_decode_f32)


@njit(inline="always")
def _axpy(qtype, weights, rows, starts, tokens, every_token, coeffs, out, n_threads):
    """``out[t] += coeffs[t, j] · W[rows[j]]`` for the tokens t of row j: all of them in order when
    ``every_token`` (``starts`` and ``tokens`` unused), else ``tokens[starts[j]:starts[j + 1]]``."""
    n_tokens, cols = out.shape
    n_blocks = cols // BLOCK
    n_chunks = min(n_threads, n_blocks)
    w_addr, row_stride = weights.ctypes.data, weights.strides[0]
    block_bytes = weights.shape[1] // n_blocks
    c_addr, c_stride = coeffs.ctypes.data, coeffs.strides[0]
    out_addr, out_stride = out.ctypes.data, out.strides[0]
    t_addr = tokens.ctypes.data
    n_rows = rows.shape[0]
    for chunk in prange(n_chunks):
        first, stop = chunk * n_blocks // n_chunks, (chunk + 1) * n_blocks // n_chunks
        for j in range(n_rows):
            if j + PREFETCH_ROWS < n_rows:  # only this thread's share of that row
                prefetch_span(w_addr + rows[j + PREFETCH_ROWS] * row_stride + first * block_bytes,
                               (stop - first) * block_bytes)
            listed, count = (0, n_tokens) if every_token else (t_addr + starts[j] * 8, starts[j + 1] - starts[j])
            _axpy_row(qtype, out_addr, out_stride, w_addr + rows[j] * row_stride, first, stop, block_bytes,
                      c_addr + j * 4, c_stride, listed, count)


@njit(inline="always")
def _axpy_row(qtype, out_addr, out_stride, row_addr, first, stop, block_bytes, coeff_addr, c_stride, tokens_addr,
              n_tokens):
    """Blocks ``first .. stop-1`` of one weight row, times its coefficient, added to the listed tokens' outputs."""
    for b in range(first, stop):
        args = (out_addr + b * BLOCK * 4, out_stride, row_addr + b * block_bytes, coeff_addr, c_stride, tokens_addr,
                n_tokens)
        if qtype == Q4_0:
            _axpy_q4_0(*args)
        elif qtype == Q8_0:
            _axpy_q8_0(*args)
        elif qtype == F16:
            _axpy_f16(*args)
        else:  # F32
            _axpy_f32(*args)


@njit(parallel=True, nogil=True, cache=True)
def axpy_rows(qtype, weights, rows, coeffs, out, n_threads):
    """``out[t] += Σ_j coeffs[t, j] · W[rows[j]]`` over a column count that is a multiple of 32."""
    _axpy(qtype, weights, rows, rows, rows, True, coeffs, out, n_threads)


@njit(parallel=True, nogil=True, cache=True)
def axpy_rows_one_token(qtype, weights, rows, coeffs, out, n_threads):
    """One token's ``out[0] += Σ_j coeffs[0, j] · W[rows[j]]`` with the threads sharing the rows, not
    each row's columns as ``axpy_rows`` does: each thread sums its run of rows into a partial of its own,
    and the partials are added to ``out`` in thread order. Splitting a 1152-byte q4_0 row between two
    threads made two threads slower than one (examples/bench_kernels.py: 3.5 against 4.4 GB/s); a
    decoded token has one output row, so the partials cost one row per thread. Columns a multiple of 32."""
    n_rows, cols = rows.shape[0], out.shape[1]
    n_blocks = cols // BLOCK
    block_bytes = weights.shape[1] // n_blocks
    n_chunks = max(1, min(n_threads, n_rows))
    partial = np.zeros((n_chunks, cols), np.float32)
    w_addr, row_stride, c_addr = weights.ctypes.data, weights.strides[0], coeffs.ctypes.data
    p_addr, p_stride = partial.ctypes.data, partial.strides[0]
    for chunk in prange(n_chunks):
        first, stop = chunk * n_rows // n_chunks, (chunk + 1) * n_rows // n_chunks
        for j in range(first, stop):
            if j + PREFETCH_ROWS < stop:
                prefetch_span(w_addr + rows[j + PREFETCH_ROWS] * row_stride, weights.shape[1])
            _axpy_row(qtype, p_addr + chunk * p_stride, p_stride, w_addr + rows[j] * row_stride, 0, n_blocks,
                      block_bytes, c_addr + j * 4, 0, 0, 1)
    for chunk in range(n_chunks):
        for c in range(cols):
            out[0, c] += partial[chunk, c]


@njit(parallel=True, nogil=True, cache=True)
def axpy_selected(qtype, weights, rows, starts, tokens, coeffs, out, n_threads):
    """``out[t] += coeffs[t, j] · W[rows[j]]`` for just the tokens ``t in tokens[starts[j]:starts[j + 1]]``
    that selected row j (a prompt, each token with its own neurons; ``tokens`` intp): each row is
    read and decoded once for all of its tokens, not once per token. Columns a multiple of 32."""
    _axpy(qtype, weights, rows, starts, tokens, False, coeffs, out, n_threads)
