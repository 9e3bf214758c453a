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
        compiled = _compiled_dequantizers().get(self.qtype) if on_host and len(raw) >= _COMPILED_MIN_ROWS else None
        if compiled is not None:
            return compiled(raw)
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
