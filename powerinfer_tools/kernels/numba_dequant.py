"""Compiled dequantization of q4_0 and q8_0 rows (NumPy arrays): what prompt processing spends its time on
besides BLAS.

The NumPy version (``quant.dequantize_blocks``) runs at 0.05-0.2 GB/s of weights (docs/kernels.md), slower
than the products it feeds. These loops give the same float32 values bit for bit (table lookups of the
exact values NumPy computes: the f16 scale as float32, q - 8 or q as float32, then one float32 product) at
~2 G values/s per thread. ``quant.QuantMatrix.dequantize_rows`` takes them where the compiled kernels are
in use.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from powerinfer_tools.formats.weight_types import Q4_0, Q8_0, WEIGHT_TYPES
from powerinfer_tools.kernels.numba_cache import prepare_cache

_F16_TO_F32 = np.arange(2**16, dtype=np.uint16).view(np.float16).astype(np.float32)  # by bit pattern
_Q4_VALUES = np.arange(-8, 8, dtype=np.float32)  # a q4_0 nibble n stands for n - 8
_Q8_VALUES = np.arange(256, dtype=np.uint8).view(np.int8).astype(np.float32)  # a q8_0 byte, as int8
_BLOCK = WEIGHT_TYPES[Q4_0].block_size  # values per block, q4_0's and q8_0's alike
_Q4_0_BYTES, _Q8_0_BYTES = WEIGHT_TYPES[Q4_0].block_bytes, WEIGHT_TYPES[Q8_0].block_bytes


@njit(parallel=True, nogil=True, cache=True)
def _decode_q4_0(raw, f16, values, out):
    for r in prange(out.shape[0]):
        src, dst = raw[r], out[r]
        for b in range(dst.shape[0] // _BLOCK):
            block, first = b * _Q4_0_BYTES, b * _BLOCK
            d = f16[np.int32(src[block]) | np.int32(src[block + 1]) << 8]
            for j in range(_BLOCK // 2):
                byte = src[block + 2 + j]
                dst[first + j] = values[byte & 15] * d
                dst[first + _BLOCK // 2 + j] = values[byte >> 4] * d


@njit(parallel=True, nogil=True, cache=True)
def _decode_q8_0(raw, f16, values, out):
    for r in prange(out.shape[0]):
        src, dst = raw[r], out[r]
        for b in range(dst.shape[0] // _BLOCK):
            block, first = b * _Q8_0_BYTES, b * _BLOCK
            d = f16[np.int32(src[block]) | np.int32(src[block + 1]) << 8]
            for j in range(_BLOCK):
                dst[first + j] = values[src[block + 2 + j]] * d


def _decoder(loop, values, block_bytes: int):
    def dequantize(raw: np.ndarray) -> np.ndarray:
        """float32 ``[rows, cols]`` from rows of GGUF blocks ``[rows, row_bytes]`` (uint8)."""
        out = np.empty((raw.shape[0], raw.shape[1] // block_bytes * _BLOCK), dtype=np.float32)
        loop(np.ascontiguousarray(raw), _F16_TO_F32, values, out)
        return out

    return dequantize


DECODERS = {Q4_0: _decoder(_decode_q4_0, _Q4_VALUES, _Q4_0_BYTES), Q8_0: _decoder(_decode_q8_0, _Q8_VALUES, _Q8_0_BYTES)}


prepare_cache(globals())  # stale machine code flushed, the rest loaded without the compiler (kernels.numba_cache)
