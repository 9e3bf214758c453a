"""A prompt's products that have no int8 GEMM of ggml's here, in bfloat16 products (AVX-512 BF16's ``vdpbf16ps``:
32 products an instruction, twice float32's FMA, summed in float32), where they were dequantized for BLAS:

* ``row_sum``: ``out [T, cols] = coeffs [T, n] @ W[rows]`` over q4_0 ``ffn_down_t``, which keeps the down
  projection transposed (a row per neuron, its scales along the output), so ggml's GEMMs, which want each
  output's weights and scales along the sum, do not apply. Each thread takes a share of the 32-column blocks
  of the output; for one block it unpacks every row's 32 weights into bfloat16 (``nibble - 8`` times the
  block's scale, rounded to nearest even), interleaved two rows at a time as ``vdpbf16ps`` reads them, once
  into a slab that stays in its L2; then eight tokens at a time run down the slab, each step one broadcast
  pair of a token's bfloat16 coefficients times the slab's pair of rows into 2 x 16 float32 sums.
* ``matmul``: ``out [T, len(rows)] = x [T, K] @ W[rows].T`` over rows of any type ggml's ``to_float``
  dequantizes (k-quants, q5_0, q8_0, f16, f32): the same tile (``_tile``) with the roles swapped, the tokens'
  inputs 32 to a slab, eight dequantized rows at a time broadcast against it.

Rounding weight and input to bfloat16 errs by at most 2^-8 of each product's size, finer than the q8_0
rounding ggml's GEMMs give their input (1/127 of each block's largest): tests/test_numba_bf16.py. Without
AVX-512 BF16 the same sums are spelled in plain vector IR (``available`` says which; the runtime takes BLAS
there), as ``numba_vnni`` does for its intrinsic.
"""

from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from powerinfer_tools.formats import weight_types
from powerinfer_tools.formats.weight_types import WEIGHT_TYPES, Kernel, check_claims
from powerinfer_tools.kernels.numba_blocks import dequantize_rows, share
from powerinfer_tools.kernels.numba_kernels import BLOCK, compiles_for, const, decode_q4_0, load, splat, store, vec
from powerinfer_tools.kernels.numba_cache import prepare_cache

TOKENS = 8  # a tile's tokens: 2 x 8 float32 sums in registers, of AVX-512's 32
_Q4_0_BLOCK_BYTES = WEIGHT_TYPES[weight_types.Q4_0].block_bytes
_PAIR_BYTES = 2 * BLOCK * 2  # two rows' 32 weights as bfloat16, interleaved: one slab step
_FEATURES = ("avx512f", "avx512bw", "avx512bf16")
_I16, _I32, _I64, _F32 = ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()


@functools.cache
def available() -> bool:
    """Whether numba compiles for a CPU with ``vdpbf16ps``: the host's features, or those NUMBA_CPU_FEATURES
    lists (NUMBA_CPU_NAME naming another CPU: no)."""
    return compiles_for(_FEATURES)


def _to_bf16(builder, floats):
    """float32 lanes as bfloat16 bit patterns (int16), rounded to nearest even (the values here are finite)."""
    n = floats.type.count
    bits = builder.bitcast(floats, vec(_I32, n))
    odd = builder.and_(builder.lshr(bits, const(_I32, n, [16] * n)), const(_I32, n, [1] * n))
    rounded = builder.add(bits, builder.add(odd, const(_I32, n, [0x7FFF] * n)))
    return builder.trunc(builder.lshr(rounded, const(_I32, n, [16] * n)), vec(_I16, n))


def _from_bf16(builder, words):
    """bfloat16 bit patterns (int16 lanes) as float32: exact."""
    n = words.type.count
    return builder.bitcast(builder.shl(builder.zext(words, vec(_I32, n)), const(_I32, n, [16] * n)), vec(_F32, n))


def _dpbf16ps(builder, acc, pairs, broadcast):
    """``acc`` (16 float32) plus, per lane, the two products of the lane's bfloat16 pair in ``pairs`` and in
    ``broadcast`` (each 32 int16 bit patterns). Without AVX-512 BF16, the same sum in plain vector IR."""
    if not available():
        for half in range(2):
            pick = const(_I32, 16, range(half, 32, 2))
            a = _from_bf16(builder, builder.shuffle_vector(pairs, pairs, pick))
            b = _from_bf16(builder, builder.shuffle_vector(broadcast, broadcast, pick))
            acc = builder.fadd(acc, builder.fmul(a, b))
        return acc
    i32x16, f32x16 = vec(_I32, 16), vec(_F32, 16)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32x16, [f32x16, i32x16, i32x16]),
                                        "llvm.x86.avx512bf16.dpbf16ps.512")
    return builder.call(fn, [acc, builder.bitcast(pairs, i32x16), builder.bitcast(broadcast, i32x16)])


@intrinsic
def _round_span(typingctx, source, target, n_chunks):
    """``n_chunks`` x 32 float32 at address ``source`` as bfloat16 at ``target``."""
    sig = types.void(types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        source_, target_, n_ = args
        with cgutils.for_range(builder, n_) as loop:
            at = builder.mul(loop.index, ir.Constant(_I64, 32 * 4))
            halves = [_to_bf16(builder, load(builder, builder.add(source_, builder.add(at, ir.Constant(_I64, 64 * h))),
                                            vec(_F32, 16))) for h in range(2)]
            words = builder.shuffle_vector(halves[0], halves[1], const(_I32, 32, range(32)))
            store(builder, words, builder.add(target_, builder.mul(loop.index, ir.Constant(_I64, 64))))
        return context.get_dummy_value()

    return sig, codegen


def _block_values(builder, block):
    """A q4_0 block's 32 weights as bfloat16: (nibble - 8) x its scale."""
    values, scale = decode_q4_0(builder, block)
    return _to_bf16(builder, builder.fmul(values, splat(builder, scale, BLOCK)))


@intrinsic
def _unpack_pair(typingctx, block_a, block_b, target):
    """Two rows' q4_0 blocks of the same 32 columns (at ``block_a``, ``block_b``) as one slab step at ``target``:
    128 bytes, column c's pair (a, b) at words 2c, 2c + 1."""
    sig = types.void(types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        a, b, target_ = args
        va, vb = _block_values(builder, a), _block_values(builder, b)
        for half in range(2):
            order = [x for c in range(16 * half, 16 * half + 16) for x in (c, 32 + c)]
            store(builder, builder.shuffle_vector(va, vb, const(_I32, 32, order)),
                  builder.add(target_, ir.Constant(_I64, 64 * half)))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _tile(typingctx, slab, coeffs, coeffs_stride, n_pairs, out):
    """Eight tokens' sums over one slab: token t's bfloat16 coefficients at ``coeffs + t * coeffs_stride``
    (``2 * n_pairs`` of them), its 32 float32 sums stored at ``out + 128 t``."""
    sig = types.void(types.intp, types.intp, types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        slab_, coeffs_, stride_, n_, out_ = args
        zero = ir.Constant(vec(_F32, 16), [0.0] * 16)
        sums = [[cgutils.alloca_once_value(builder, zero) for _ in range(2)] for _ in range(TOKENS)]
        with cgutils.for_range(builder, n_) as loop:
            step = builder.add(slab_, builder.mul(loop.index, ir.Constant(_I64, _PAIR_BYTES)))
            pairs = [load(builder, builder.add(step, ir.Constant(_I64, 64 * h)), vec(_I16, 32)) for h in range(2)]
            at = builder.add(coeffs_, builder.mul(loop.index, ir.Constant(_I64, 4)))
            for t in range(TOKENS):
                pair = load(builder, builder.add(at, builder.mul(stride_, ir.Constant(_I64, t))), _I32)
                broadcast = builder.bitcast(splat(builder, pair, 16), vec(_I16, 32))
                for h in range(2):
                    builder.store(_dpbf16ps(builder, builder.load(sums[t][h]), pairs[h], broadcast), sums[t][h])
        for t in range(TOKENS):
            for h in range(2):
                store(builder, builder.load(sums[t][h]), builder.add(out_, ir.Constant(_I64, 128 * t + 64 * h)))
        return context.get_dummy_value()

    return sig, codegen


@njit(nogil=True, cache=True)
def _round_scalar(value):
    """One float32 as ``_to_bf16`` rounds it (a span's tail)."""
    bits = np.array([value], np.float32).view(np.uint32)[0]
    return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@njit(inline="always")
def _padded(n):
    return -(-n // 32) * 32


@njit(inline="always")
def _rounded(a, rows_multiple):
    """The rows of ``a`` (float32, each contiguous) as bfloat16, zero-padded to a multiple of ``rows_multiple``
    rows and of 32 columns: the tiles read whole groups of both."""
    n_rows, n_cols = a.shape
    out = np.zeros((-(-n_rows // rows_multiple) * rows_multiple, _padded(n_cols)), np.uint16)
    whole = n_cols // 32 * 32
    for t in prange(n_rows):
        _round_span(a[t].ctypes.data, out[t].ctypes.data, n_cols // 32)
        for i in range(whole, n_cols):
            out[t, i] = _round_scalar(a[t, i])
    return out


_CHUNK_BYTES = 512 << 10  # a thread's chunk of rows, as float32 and bfloat16: in its L2 while the tiles read it


def chunk_rows(cols: int) -> int:
    """Rows a thread of ``matmul`` dequantizes at a time (``floats`` and ``rounded_rows``): a multiple of
    ``TOKENS``."""
    return max(TOKENS, _CHUNK_BYTES // (6 * cols) // TOKENS * TOKENS)


def slab_bytes(n: int) -> int:
    """A thread's slab for ``n`` rows (``row_sum``'s ``slabs``)."""
    return _padded(n) // 2 * _PAIR_BYTES


@njit(parallel=True, nogil=True, cache=True)
def row_sum(weights, rows, coeffs, out, slabs, tiles):
    """``out [T, cols] = coeffs [T, n] @ W[rows]`` for q4_0 rows (``weights`` their bytes ``[rows, row_bytes]``),
    ``coeffs`` float32 with contiguous rows. Scratch: ``slabs`` uint8 ``[threads, slab_bytes(n)]`` and ``tiles``
    float32 ``[threads, TOKENS, 32]``."""
    n_tokens, n_rows = coeffs.shape
    cols, n = out.shape[1], _padded(n_rows)
    rounded = _rounded(coeffs, TOKENS)
    w, row_bytes, n_threads = weights.ctypes.data, weights.strides[0], slabs.shape[0]
    for thread in prange(n_threads):
        first, stop = share(cols // BLOCK, thread, n_threads)
        slab, tile = slabs[thread].ctypes.data, tiles[thread]
        for block in range(first, stop):
            at = w + block * _Q4_0_BLOCK_BYTES
            for k in range(n // 2):  # rows past the last: any row, times zero coefficients
                _unpack_pair(at + rows[min(2 * k, n_rows - 1)] * row_bytes,
                             at + rows[min(2 * k + 1, n_rows - 1)] * row_bytes, slab + k * _PAIR_BYTES)
            for t in range(0, n_tokens, TOKENS):
                _tile(slab, rounded[t].ctypes.data, rounded.strides[0], n // 2, tile.ctypes.data)
                for i in range(min(TOKENS, n_tokens - t)):
                    for c in range(BLOCK):
                        out[t + i, block * BLOCK + c] = tile[i, c]


check_claims(Kernel.BF16_ROW_SUM, (weight_types.Q4_0,), __name__)  # row_sum unpacks q4_0 blocks alone
# (matmul takes rows of every type: ggml's to_float dequantizes them; the rows that claim it are those it pays for)


@njit(parallel=True, nogil=True, cache=True)
def matmul(to_float, weights, rows, x, out, floats, rounded_rows, tiles):
    """``out [T, len(rows)] = x [T, K] @ W[rows].T`` for rows of any type ggml's ``to_float`` dequantizes (0: f32
    rows), ``K`` a multiple of 32, ``x`` float32 with contiguous rows. The roles of ``row_sum`` swapped: the
    tokens' bfloat16 pairs, 32 tokens to a slab, are the vector side, and eight weight rows at a time the
    broadcast side. Each thread dequantizes its share of the rows a chunk at a time into ``floats`` and
    rounds them into ``rounded_rows`` (``[threads, chunk, K]``, chunk a multiple of ``TOKENS``); ``tiles``
    float32 ``[threads, TOKENS, 32]``."""
    n_tokens, k = x.shape
    n_blocks, n, chunk = -(-n_tokens // 32), rows.shape[0], floats.shape[1]
    pairs = _rounded(x, 32).view(np.uint32)
    slabs = np.empty((n_blocks, k // 2, 32), np.uint32)  # slabs[b, p, c]: pair p of token 32 b + c
    for b in prange(n_blocks):
        for p in range(k // 2):
            for c in range(32):
                slabs[b, p, c] = pairs[32 * b + c, p]
    n_threads = floats.shape[0]
    for thread in prange(n_threads):
        first, stop = share(-(-n // TOKENS), thread, n_threads)  # groups of eight rows
        buffer, weights_bf16, tile = floats[thread], rounded_rows[thread], tiles[thread]
        for start in range(first * TOKENS, stop * TOKENS, chunk):
            end = min(start + chunk, stop * TOKENS)
            dequantize_rows(to_float, weights, rows, start, min(end, n), buffer)
            for i in range(start, end):
                if i >= n:  # the last group's rows past the last: zeros (a loop: see numba_blocks.dequantize_rows)
                    for j in range(k):
                        buffer[i - start, j] = 0
                _round_span(buffer[i - start].ctypes.data, weights_bf16[i - start].ctypes.data, k // 32)
            for g in range(start, end, TOKENS):
                for b in range(n_blocks):
                    _tile(slabs[b].ctypes.data, weights_bf16[g - start].ctypes.data, weights_bf16.strides[0], k // 2,
                          tile.ctypes.data)
                    for i in range(min(TOKENS, n - g)):
                        for c in range(min(32, n_tokens - 32 * b)):
                            out[32 * b + c, g + i] = tile[i, c]


prepare_cache(globals())  # stale machine code flushed, the rest loaded without the compiler (kernels.numba_cache)
