"""q4_0 matrices with their rows interleaved eight at a time: the layout of ggml's repacked kernels.

llama.cpp's CPU backend does not multiply q4_0 weights as stored: at load it rewrites them into ``block_q4_0x8``
groups (the "CPU_REPACK" buffer type) and runs ``ggml_gemv_q4_0_8x8_q8_0`` (one token) and
``ggml_gemm_q4_0_8x8_q8_0`` (four tokens at a time) over them, which produce eight rows' outputs per pass over the
input. On a TinyLlama gate matrix (5632 x 2048) that is faster than ``vec_dot`` row by row for one token, with the
weights in cache or from memory, and than dequantize + BLAS for 128 tokens on one thread
(``examples/bench_kernels.py`` measures them; docs/lab/kernels.md). Matrices that are always multiplied whole
(attention, a q4_0 output head) are stored this way on the CPU; a sparse FFN's gate and up are not, since a
predicted neuron's row must be readable alone: a prompt that needs every one of their rows gets a copy interleaved
for that product (``CpuBackend.matmul``; the compiled copy, ``numba_interleaved.interleave``, costs little beside
the GEMM).

The layout (``ggml-cpu/repack.cpp``): rows are taken eight at a time; for each 32-column block of
those eight rows, one 144-byte group holds the eight f16 scales, then 128 bytes of quants in which
8-byte piece ``i`` is bytes ``8 * (i // 8) .. + 8`` of row ``i % 8``'s block, each nibble XORed with
8 (so that it reads as a signed 4-bit value). A group of eight rows is as many bytes as the eight
rows were, so interleaving costs no memory beyond the copy.

``InterleavedQ4.matmul`` is the NumPy reference (undo the layout, then ``QuantMatrix.matmul``); the
compiled products are ``kernels.interleaved_matmul`` and the compiled decode path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from powerinfer_tools.formats.weight_types import Q4_0, WEIGHT_TYPES, Kernel, check_claims
from powerinfer_tools.kernels.quant import QuantMatrix

ROWS = 8  # rows per interleaved group
_BLOCK, _BLOCK_BYTES = WEIGHT_TYPES[Q4_0].block_size, WEIGHT_TYPES[Q4_0].block_bytes
SCALE_BYTES = 2  # a block's f16 scale, before its quants
PIECE = 8  # bytes of one row's quants that sit together in a group


@dataclass(frozen=True)
class InterleavedQ4:
    """A q4_0 ``[rows, cols]`` matrix stored as ``[rows / 8, 8 * row_bytes]`` uint8 interleaved groups."""

    data: np.ndarray
    cols: int
    qtype = Q4_0

    @property
    def rows(self) -> int:
        return self.data.shape[0] * ROWS

    @property
    def row_bytes(self) -> int:
        return self.cols // _BLOCK * _BLOCK_BYTES

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def deinterleaved(self) -> QuantMatrix:
        """The matrix in GGUF's row layout again."""
        groups, blocks = self.data.shape[0], self.cols // _BLOCK
        g = self.data.reshape(groups, blocks, ROWS * _BLOCK_BYTES)
        scales = g[..., : ROWS * SCALE_BYTES].reshape(groups, blocks, ROWS, SCALE_BYTES)
        quants = (g[..., ROWS * SCALE_BYTES :] ^ 0x88).reshape(groups, blocks, 2, ROWS, PIECE)
        quants = quants.transpose(0, 1, 3, 2, 4).reshape(groups, blocks, ROWS, 2 * PIECE)
        rows = np.concatenate([scales, quants], axis=3).transpose(0, 2, 1, 3)
        return QuantMatrix(self.qtype, rows.reshape(self.rows, self.row_bytes))

    def matmul(self, x: np.ndarray, rows: None = None) -> np.ndarray:
        """``x [T, cols] @ W.T``: the NumPy reference."""
        if rows is not None:
            raise ValueError("an interleaved matrix is multiplied whole")
        return self.deinterleaved().matmul(x)


check_claims(Kernel.INTERLEAVED, (InterleavedQ4.qtype,), __name__)  # the layout is q4_0's (ggml's block_q4_0x8)


def can_interleave(m: QuantMatrix) -> bool:
    """Whether ``m`` has the interleaved layout: a type that claims it (q4_0), whole groups of eight rows, on the
    host."""
    return WEIGHT_TYPES[m.qtype].has(Kernel.INTERLEAVED) and m.rows % ROWS == 0 and isinstance(m.data, np.ndarray)


def interleave(m: QuantMatrix) -> InterleavedQ4:
    """``m`` (``can_interleave``) in eight-row groups: a new array of the same size."""
    groups, blocks = m.rows // ROWS, m.cols // _BLOCK
    b = np.asarray(m.data).reshape(groups, ROWS, blocks, _BLOCK_BYTES).transpose(0, 2, 1, 3)
    scales = b[..., :SCALE_BYTES].reshape(groups, blocks, ROWS * SCALE_BYTES)
    # piece i of a group is row i % 8's bytes 8 * (i // 8) ..: the two halves of every row's 16 quant bytes
    quants = b[..., SCALE_BYTES:].reshape(groups, blocks, ROWS, 2, PIECE).transpose(0, 1, 3, 2, 4)
    quants = quants.reshape(groups, blocks, ROWS * 2 * PIECE) ^ 0x88
    data = np.concatenate([scales, quants], axis=2).reshape(groups, blocks * ROWS * _BLOCK_BYTES)
    return InterleavedQ4(data, m.cols)
