"""Weight matrices kept in their GGUF encoding (the types of ``formats/weight_types.py``) and read in place.

A ``QuantMatrix`` wraps the memory-mapped bytes of one 2-D tensor, rows
contiguous, exactly as GGUF lays them out. Nothing is expanded to float32 for
the whole model: each product dequantizes only the rows it needs, in chunks.
These NumPy routines are the reference that compiled kernels are tested against.
Rows are dequantized bit for bit as gguf's reference does: by compiled loops of ours
(q4_0, q8_0), by ggml's ``to_float`` (``kernels.ggml_base``: the other block types), or
by gguf's NumPy code where neither is at hand.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from powerinfer_tools.formats.weight_types import F16, F32, Q4_0, Q8_0, WEIGHT_TYPES
from powerinfer_tools.kernels import ggml_base
from powerinfer_tools.xp import array_namespace

SUPPORTED_TYPES = tuple(WEIGHT_TYPES)
_CHUNK_ROWS = 1024  # rows dequantized at a time: bounds the float32 scratch to a few MB


@dataclass(frozen=True)
class QuantMatrix:
    """A ``[rows, cols]`` matrix stored as ``qtype``; ``data`` is ``[rows, row_bytes]`` uint8
    for block-quantized types and ``[rows, cols]`` float for f32/f16."""

    qtype: GGMLQuantizationType
    data: np.ndarray

    def __post_init__(self):
        if self.qtype not in SUPPORTED_TYPES:
            raise ValueError(f"weight type {self.qtype.name} is not supported by the runtime")
        if self.data.ndim != 2:
            raise ValueError(f"expected a 2-D weight, got shape {self.data.shape}")

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def cols(self) -> int:
        t = WEIGHT_TYPES[self.qtype]
        return self.row_bytes // t.block_bytes * t.block_size

    @property
    def row_bytes(self) -> int:
        return self.data.shape[1] * self.data.itemsize

    def dequantize_rows(self, rows: np.ndarray | slice | None = None) -> np.ndarray:
        """float32 ``[k, cols]`` for the given row indices (all rows when None)."""
        raw = self.data if rows is None else self.data[rows]
        on_host = array_namespace(raw) is np
        if on_host and self.qtype in _BLOCK_DECODERS and len(raw) >= _COMPILED_MIN_ROWS:
            return _dequantize_compiled(raw, self.qtype)
        base = ggml_base.loaded()
        if on_host and self.qtype not in _ARRAY_DECODED and base is not None:
            return base.dequantize(raw, self.qtype)
        return dequantize_blocks(raw, self.qtype)

    def matmul(self, x: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """``x [T, cols] @ W[rows].T``: one output column per (selected) row."""
        n = self.rows if rows is None else len(rows)
        out = array_namespace(x).empty((x.shape[0], n), dtype=np.float32)
        for start in range(0, n, _CHUNK_ROWS):
            stop = min(start + _CHUNK_ROWS, n)
            chunk = slice(start, stop) if rows is None else rows[start:stop]
            out[:, start:stop] = x @ self.dequantize_rows(chunk).T
        return out

    def weighted_row_sum(self, coeffs: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """``coeffs [T, k] @ W[rows]``: the axpy a transposed down projection needs (``ffn_down_t``)."""
        n = self.rows if rows is None else len(rows)
        out = array_namespace(coeffs).zeros((coeffs.shape[0], self.cols), dtype=np.float32)
        for start in range(0, n, _CHUNK_ROWS):
            stop = min(start + _CHUNK_ROWS, n)
            chunk = slice(start, stop) if rows is None else rows[start:stop]
            out += coeffs[:, start:stop] @ self.dequantize_rows(chunk)
        return out

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


# --- compiled dequantization (NumPy arrays): what prompt processing spends its time on besides BLAS.
# The NumPy version below runs at 0.05-0.2 GB/s of weights (docs/kernels.md), slower than the
# products it feeds. These loops give the same float32 values bit for bit (table lookups of the
# exact values NumPy computes: the f16 scale as float32, q - 8 or q as float32, then one float32
# product) at ~2 G values/s per thread.

try:
    from numba import njit, prange
except ImportError:  # numba missing: the NumPy path serves
    njit = None

_COMPILED_MIN_ROWS = 16  # fewer rows (an embedding lookup) are not worth a fork/join of the thread pool
_F16_TO_F32 = np.arange(2**16, dtype=np.uint16).view(np.float16).astype(np.float32)  # by bit pattern
_Q4_VALUES = np.arange(-8, 8, dtype=np.float32)  # a q4_0 nibble n stands for n - 8
_Q8_VALUES = np.arange(256, dtype=np.uint8).view(np.int8).astype(np.float32)  # a q8_0 byte, as int8
_BLOCK = WEIGHT_TYPES[Q4_0].block_size  # values per block, q4_0's and q8_0's alike
_Q4_0_BYTES, _Q8_0_BYTES = WEIGHT_TYPES[Q4_0].block_bytes, WEIGHT_TYPES[Q8_0].block_bytes

if njit is not None:

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

    _BLOCK_DECODERS = {Q4_0: (_decode_q4_0, _Q4_VALUES), Q8_0: (_decode_q8_0, _Q8_VALUES)}
else:
    _BLOCK_DECODERS = {}


def _dequantize_compiled(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    t = WEIGHT_TYPES[qtype]
    decode, values = _BLOCK_DECODERS[qtype]
    out = np.empty((raw.shape[0], raw.shape[1] // t.block_bytes * t.block_size), dtype=np.float32)
    decode(np.ascontiguousarray(raw), _F16_TO_F32, values, out)
    return out


_ARRAY_DECODED = (F32, F16, Q8_0, Q4_0)  # the types dequantize_blocks decodes with array operations


def dequantize_blocks(raw, qtype: GGMLQuantizationType):
    """float32 rows from GGUF-encoded rows, with array operations that run on NumPy and CuPy alike
    for the types of ``_ARRAY_DECODED``; other types by gguf's NumPy dequantizer (a device's rows go
    through the host for it).

    q8_0 blocks: an f16 scale then 32 int8 values. q4_0 blocks: an f16 scale then
    16 bytes whose low nibbles are elements 0-15 and high nibbles 16-31, each
    stored with an offset of 8.
    """
    xp = array_namespace(raw)
    if qtype not in _ARRAY_DECODED:
        return xp.asarray(WEIGHT_TYPES[qtype].dequantize(raw if xp is np else xp.asnumpy(raw)))
    if qtype is F32:
        return xp.asarray(raw, dtype=xp.float32)
    if qtype is F16:
        return raw.astype(xp.float32)
    t = WEIGHT_TYPES[qtype]
    rows, n_blocks = raw.shape[0], raw.shape[1] // t.block_bytes
    blocks = xp.asarray(raw).reshape(rows, n_blocks, t.block_bytes)
    scale = xp.ascontiguousarray(blocks[:, :, :2]).view(xp.float16).astype(xp.float32)
    if qtype is Q8_0:
        values = blocks[:, :, 2:].astype(xp.int8).astype(xp.float32)
    else:
        packed = blocks[:, :, 2:]
        nibbles = xp.concatenate([packed & 0x0F, packed >> 4], axis=-1)
        values = nibbles.astype(xp.float32) - 8
    return (values * scale).reshape(rows, -1)
