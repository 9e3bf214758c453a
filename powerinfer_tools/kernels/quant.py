"""Weight matrices kept in their GGUF encoding (the types of ``formats/weight_types.py``) and read in place.

A ``QuantMatrix`` wraps the memory-mapped bytes of one 2-D tensor, rows
contiguous, exactly as GGUF lays them out. Nothing is expanded to float32 for
the whole model: each product dequantizes only the rows it needs, in chunks.
These NumPy routines are the reference that compiled kernels are tested against.
Rows are dequantized bit for bit as gguf's reference does: by compiled loops of ours
(``kernels.numba_dequant``: the types that claim ``Kernel.COMPILED_DECODE``), by the array
decoders here (``Kernel.ARRAY_DECODE``: f32, f16, q8_0, q4_0), by ggml's ``to_float``
(``kernels.ggml_base``: the other types), or by gguf's NumPy code where none of these is at hand.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from powerinfer_tools.formats.weight_types import F16, F32, Q4_0, Q8_0, WEIGHT_TYPES, Kernel, implementations
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
        compiled = _compiled_dequantizers().get(self.qtype) if on_host and len(raw) >= _COMPILED_MIN_ROWS else None
        if compiled is not None:
            return compiled(raw)
        base = ggml_base.loaded()
        if on_host and self.qtype not in ARRAY_DECODERS and base is not None:
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


_COMPILED_MIN_ROWS = 16  # fewer rows (an embedding lookup) are not worth a fork/join of the thread pool


def _compiled_dequantizers() -> dict:
    """numba's dequantizers by type (``kernels.numba_dequant``), or none where the compiled kernels are not
    in use in this process (numba missing, or the reference kernels chosen: ``kernels.use_reference``)."""
    from powerinfer_tools import kernels  # which imports this module

    if kernels.reference_chosen():
        return {}
    try:
        from powerinfer_tools.kernels import numba_dequant
    except ImportError:  # numba missing: the NumPy path serves
        return {}
    return numba_dequant.DECODERS


def dequantize_blocks(raw, qtype: GGMLQuantizationType):
    """float32 rows from GGUF-encoded rows, with array operations that run on NumPy and CuPy alike
    for the types of ``ARRAY_DECODERS``; other types by gguf's NumPy dequantizer (a device's rows go
    through the host for it)."""
    xp = array_namespace(raw)
    decode = ARRAY_DECODERS.get(qtype)
    if decode is None:
        return xp.asarray(WEIGHT_TYPES[qtype].dequantize(raw if xp is np else xp.asnumpy(raw)))
    return decode(xp, raw)


def _f32_rows(xp, raw):
    return xp.asarray(raw, dtype=xp.float32)


def _f16_rows(xp, raw):
    return raw.astype(xp.float32)


def _scaled_blocks(xp, raw, qtype: GGMLQuantizationType, values):
    """Rows of ``qtype`` blocks that each start with an f16 scale: ``values(quants)`` (the float32 values of the
    bytes after it, ``[rows, blocks, block_size]``) times the scale."""
    t = WEIGHT_TYPES[qtype]
    rows, n_blocks = raw.shape[0], raw.shape[1] // t.block_bytes
    blocks = xp.asarray(raw).reshape(rows, n_blocks, t.block_bytes)
    scale = xp.ascontiguousarray(blocks[:, :, :2]).view(xp.float16).astype(xp.float32)
    return (values(blocks[:, :, 2:]) * scale).reshape(rows, -1)


def _q8_0_rows(xp, raw):
    """q8_0 blocks: an f16 scale, then 32 int8 values."""
    return _scaled_blocks(xp, raw, Q8_0, lambda quants: quants.astype(xp.int8).astype(xp.float32))


def _q4_0_rows(xp, raw):
    """q4_0 blocks: an f16 scale, then 16 bytes whose low nibbles are elements 0-15 and high nibbles 16-31, each
    stored with an offset of 8."""
    return _scaled_blocks(xp, raw, Q4_0,
                          lambda quants: xp.concatenate([quants & 0x0F, quants >> 4], axis=-1).astype(xp.float32) - 8)


# The array decoders by type, for the rows that claim them (f32 and f16 rows are floats already)
ARRAY_DECODERS = implementations(Kernel.ARRAY_DECODE, {F32: _f32_rows, F16: _f16_rows, Q8_0: _q8_0_rows,
                                                       Q4_0: _q4_0_rows}, __name__)
