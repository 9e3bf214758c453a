"""Compiled dequantization of rows (NumPy arrays) of the types that claim ``Kernel.COMPILED_DECODE`` (q4_0, q8_0):
what prompt processing spends its time on besides BLAS.

The NumPy version (``quant.dequantize_blocks``) is slower than the products it feeds. These loops decode each
block with the axpy's block decoder of its type (``numba_kernels.BLOCK_DECODERS``: the one compiled q4_0 decoder)
and give the same float32 values bit for bit: a block's values (q - 8, or q, as float32: exact) times its f16
scale as float32, one float32 product each, as NumPy computes them. ``quant.QuantMatrix.dequantize_rows`` takes
them where the compiled kernels are in use.
"""

from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from powerinfer_tools.formats.weight_types import WEIGHT_TYPES, Kernel, implementations
from powerinfer_tools.kernels.numba_kernels import (BLOCK, BLOCK_DECODERS, refuse_unclaimed, splat, store,
                                                     switch_on_type, type_mask)
from powerinfer_tools.kernels.numba_cache import prepare_cache

_DECODED = implementations(Kernel.COMPILED_DECODE, BLOCK_DECODERS, __name__)  # block decoders by type
# A row is walked in blocks of the decoders' BLOCK values: the types here are those of such blocks (not f32/f16)
assert all(WEIGHT_TYPES[qtype].block_size == BLOCK for qtype in _DECODED)
_TYPES = type_mask(_DECODED)
_I64 = ir.IntType(64)


@intrinsic
def _decode_row(typingctx, qtype, row, out, n_blocks, block_bytes):
    """The ``n_blocks`` blocks (``block_bytes`` each) of the row at address ``row``, of a type of ``_DECODED``, as
    float32 at address ``out``."""
    sig = types.void(*[types.intp] * 5)

    def codegen(context, builder, signature, args):
        qtype_, row_, out_, n_blocks_, block_bytes_ = args

        def decode_row(decode):
            with cgutils.for_range(builder, n_blocks_) as loop:
                values, scale = decode(builder, builder.add(row_, builder.mul(loop.index, block_bytes_)))
                store(builder, builder.fmul(values, splat(builder, scale, BLOCK)),
                      builder.add(out_, builder.mul(loop.index, ir.Constant(_I64, 4 * BLOCK))))

        switch_on_type(builder, qtype_, {t: functools.partial(decode_row, decode) for t, decode in _DECODED.items()})
        return context.get_dummy_value()

    return sig, codegen


@njit(parallel=True, nogil=True, cache=True)
def _decode_rows(qtype, raw, out):
    refuse_unclaimed(_TYPES, qtype)
    n_blocks = out.shape[1] // BLOCK
    block_bytes = raw.shape[1] // max(n_blocks, 1)
    for r in prange(out.shape[0]):
        _decode_row(qtype, raw.ctypes.data + r * raw.strides[0], out.ctypes.data + r * out.strides[0], n_blocks,
                    block_bytes)


def _dequantize(qtype, raw: np.ndarray) -> np.ndarray:
    """float32 ``[rows, cols]`` from rows of ``qtype``'s GGUF blocks ``[rows, row_bytes]`` (uint8)."""
    t = WEIGHT_TYPES[qtype]
    out = np.empty((raw.shape[0], raw.shape[1] // t.block_bytes * t.block_size), dtype=np.float32)
    _decode_rows(int(qtype), np.ascontiguousarray(raw), out)
    return out


DECODERS = {qtype: functools.partial(_dequantize, qtype) for qtype in _DECODED}


prepare_cache(globals())  # stale machine code flushed, the rest loaded without the compiler (kernels.numba_cache)
