"""Every GGML weight type the project knows, in one table, as ggml's own type traits tables have them.

One row per type (``WEIGHT_TYPES``): its ggml id (gguf's ``GGMLQuantizationType``), the size of a
block and of its bytes (gguf's ``GGML_QUANT_SIZES``, which ``kernels.ggml_base`` checks against the
ggml library at load), the reference dequantizer (gguf's NumPy ``dequantize``, bit for bit ggml's
``to_float``), the type x is encoded as for ggml-cpu's ``vec_dot`` (its ``type_traits_cpu``
``vec_dot_type``), whether the kernels of ``kernels/`` decode it themselves, and the facts the
converter needs. Every list of types and every byte count in the package is derived from here:
adding a type the runtime computes is one row.

The types without kernels of our own are computed as llama.cpp computes them: a product of rows
with x through ggml's ``vec_dot`` (x encoded by the ``from_float`` of ``vec_dot_type``), and float
rows, where a product needs them (the down projection's axpy, a prompt's BLAS products), from
ggml's ``to_float``. A k-quant row holds a whole number of 256-value super-blocks, and so does x
encoded as q8_K for it: GGUF cannot store a row that is not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType
from gguf.quants import dequantize

F32 = GGMLQuantizationType.F32
F16 = GGMLQuantizationType.F16
BF16 = GGMLQuantizationType.BF16
Q4_0 = GGMLQuantizationType.Q4_0
Q4_1 = GGMLQuantizationType.Q4_1
Q5_0 = GGMLQuantizationType.Q5_0
Q5_1 = GGMLQuantizationType.Q5_1
Q8_0 = GGMLQuantizationType.Q8_0
Q8_1 = GGMLQuantizationType.Q8_1
Q2_K = GGMLQuantizationType.Q2_K
Q3_K = GGMLQuantizationType.Q3_K
Q4_K = GGMLQuantizationType.Q4_K
Q5_K = GGMLQuantizationType.Q5_K
Q6_K = GGMLQuantizationType.Q6_K
Q8_K = GGMLQuantizationType.Q8_K
IQ4_NL = GGMLQuantizationType.IQ4_NL
IQ4_XS = GGMLQuantizationType.IQ4_XS
IQ3_S = GGMLQuantizationType.IQ3_S
TQ1_0 = GGMLQuantizationType.TQ1_0
TQ2_0 = GGMLQuantizationType.TQ2_0


@dataclass(frozen=True)
class WeightType:
    """One GGML type that weights are stored in and the runtime computes with."""

    qtype: GGMLQuantizationType
    vec_dot_type: GGMLQuantizationType  # x's encoding for ggml-cpu's vec_dot (type_traits_cpu)
    own_kernels: bool  # kernels/ decodes it itself (numba_kernels' axpy; compiled decoders, VNNI for q4_0/q8_0)
    file_type: LlamaFileType | None = None  # the file type llama.cpp records when `pitools convert --outtype` writes it
    powerinfer_axpy: bool = False  # PowerInfer's CPU runtime reads ffn_down_t in this type (its ggml_axpy has it)

    @property
    def name(self) -> str:
        """As ``--outtype`` and llama.cpp spell it: ``q4_0``, ``q6_k``."""
        return self.qtype.name.lower()

    @property
    def block_size(self) -> int:
        """Values per block (1 for f32/f16)."""
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def block_bytes(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][1]

    @property
    def bytes_per_param(self) -> float:
        return self.block_bytes / self.block_size

    def row_bytes(self, cols: int) -> int:
        """Bytes of a row of ``cols`` values (a whole number of blocks)."""
        return cols // self.block_size * self.block_bytes

    def encoded_bytes(self, cols: int) -> int:
        """Bytes of a ``cols``-long x encoded as ``vec_dot_type``, for one ``vec_dot`` with a row."""
        block_size, block_bytes = GGML_QUANT_SIZES[self.vec_dot_type]
        return cols // block_size * block_bytes

    def dequantize(self, data: np.ndarray) -> np.ndarray:
        """Stored rows as float32: gguf's reference, bit for bit ggml's ``to_float``."""
        return np.asarray(dequantize(data, self.qtype), dtype=np.float32)


WEIGHT_TYPES = {
    t.qtype: t
    for t in (
        WeightType(F32, F32, True, LlamaFileType.ALL_F32),
        WeightType(F16, F16, True, LlamaFileType.MOSTLY_F16, powerinfer_axpy=True),
        WeightType(Q8_0, Q8_0, True, LlamaFileType.MOSTLY_Q8_0),
        WeightType(Q4_0, Q8_0, True, LlamaFileType.MOSTLY_Q4_0, powerinfer_axpy=True),
        # q4_1 and q5_1 blocks carry a minimum besides the scale: vec_dot wants x with its block sums (q8_1)
        WeightType(Q4_1, Q8_1, False),
        WeightType(Q5_0, Q8_0, False),
        WeightType(Q5_1, Q8_1, False),
        WeightType(Q4_K, Q8_K, False),
        WeightType(Q5_K, Q8_K, False),
        WeightType(Q6_K, Q8_K, False),
        # Q3_K_M's and Q2_K's k-quants; IQ4_XS, and IQ4_NL (where an IQ4_XS file's rows are not whole 256-value blocks)
        WeightType(Q2_K, Q8_K, False),
        WeightType(Q3_K, Q8_K, False),
        WeightType(IQ4_NL, Q8_0, False),
        WeightType(IQ4_XS, Q8_K, False),
        WeightType(IQ3_S, Q8_K, False),  # IQ3_S and IQ3_M files
        WeightType(TQ1_0, Q8_K, False),  # ternary weights (BitNet b1.58, TriLM)
        WeightType(TQ2_0, Q8_K, False),
        WeightType(BF16, BF16, False),  # a full-precision download's; vec_dot takes x rounded to bfloat16
    )
}
