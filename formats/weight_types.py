"""Every GGML weight type the project knows, in one table, as ggml's own type traits tables have them.

One row per type (``WEIGHT_TYPES``): its ggml id (gguf's ``GGMLQuantizationType``), the size of a
block and of its bytes (gguf's ``GGML_QUANT_SIZES``, which ``kernels.ggml_base`` checks against the
ggml library at load), the reference dequantizer (gguf's NumPy ``dequantize``, bit for bit ggml's
``to_float``), the type x is encoded as for ggml-cpu's ``vec_dot`` (its ``type_traits_cpu``
``vec_dot_type``), which kernels of ``kernels/`` take it (``kernels``, of ``Kernel``), and the facts the
converter needs. Every list of types and every byte count in the package is derived from here, and so is
every answer to "does kernel X take type Y" (``WeightType.has``, ``types_with``): adding a type the
runtime computes is one row.

Each module that implements a kernel checks the rows' claims of it against the types it has code for once, at
its import (``check_claims``; ``implementations`` also builds the table by type that it dispatches through): a
row that claims a kernel its module lacks fails that import (``KernelClaimError``), and a type no row claims it
for has no entry in the table, so that nothing falls through to another type's code.

Every row is computed by ggml too, as llama.cpp computes it: a product of rows with x through ggml's
``vec_dot`` (x encoded by the ``from_float`` of ``vec_dot_type``), and float rows, where a product needs
them (the down projection's axpy, a prompt's BLAS products), from ggml's ``to_float`` (every type but
f32); ``kernels.ggml_ops`` and ``ggml_base`` check both against the library for every row at load. The
kernels of ours replace them where a row claims one. A k-quant row holds a whole number of 256-value
super-blocks, and so does x encoded as q8_K for it: GGUF cannot store a row that is not.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TypeVar

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


class Kernel(enum.Enum):
    """A kernel of ours that takes some weight types and not others; a row claims those it takes."""

    ARRAY_DECODE = "array decoder"  # kernels.quant.dequantize_blocks: rows as float32 by array operations (NumPy, CuPy)
    COMPILED_DECODE = "compiled decoder"  # kernels.numba_dequant: rows as float32, compiled (dequantize_rows)
    AXPY = "axpy"  # numba_kernels' axpy over rows: ffn_down_t's (kernels.row_axpy, the compiled decoder, batched)
    VNNI_ROW_DOT = "VNNI row dot"  # numba_vnni.dot_rows: one token's rows with AVX-512 VNNI (kernels.matvec)
    VNNI_VEC_DOT = "VNNI vec_dot"  # numba_kquants: ggml's vec_dot interface, one row with AVX-512 VNNI (k-quants)
    VNNI_GATE_UP = "VNNI gate/up rows"  # the compiled decoder's gate and up rows through numba_vnni (ffn_decode)
    INTERLEAVED = "interleaved gemv/gemm"  # kernels.interleaved's layout, ggml's gemv/gemm over it, numba_vnni's
    BF16_ROW_SUM = "bfloat16 row sum"  # numba_bf16.row_sum: a prompt's axpy over ffn_down_t in bfloat16 products
    # numba_bf16.matmul: a prompt's products in bfloat16, the rows dequantized by ggml's to_float. Claimed by the
    # types no finer than bfloat16 (quantized ones, bf16 itself); f32 and f16 keep their precision with BLAS.
    BF16_MATMUL = "bfloat16 matmul"
    NARROW_ROW_DOT = "narrow row dot"  # numba_kernels.f16_row_dot: a predictor's narrow rows, without vec_dot


class KernelClaimError(RuntimeError):
    """A row claims a kernel whose module has no implementation for its type."""


@dataclass(frozen=True)
class WeightType:
    """One GGML type that weights are stored in and the runtime computes with."""

    qtype: GGMLQuantizationType
    vec_dot_type: GGMLQuantizationType  # x's encoding for ggml-cpu's vec_dot (type_traits_cpu)
    kernels: frozenset[Kernel]  # the kernels of ours that take it (ggml's take every row)
    file_type: LlamaFileType | None = None  # the file type llama.cpp records when `pitools convert --outtype` writes it
    powerinfer_axpy: bool = False  # PowerInfer's CPU runtime reads ffn_down_t in this type (its ggml_axpy has it)

    def has(self, kernel: Kernel) -> bool:
        """Whether ``kernel`` takes this type."""
        return kernel in self.kernels

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


# A quantized type without kernels of ours but the bfloat16 matmul: computed by ggml's vec_dot and to_float
_GGML_QUANTIZED = frozenset({Kernel.BF16_MATMUL})
# A k-quant whose rows numba_kquants multiplies with one token in place of ggml's vec_dot (q4_k)
_KQUANT_VNNI = frozenset({Kernel.BF16_MATMUL, Kernel.VNNI_VEC_DOT})

WEIGHT_TYPES = {
    t.qtype: t
    for t in (
        WeightType(F32, F32, frozenset({Kernel.ARRAY_DECODE, Kernel.AXPY}), LlamaFileType.ALL_F32),
        WeightType(F16, F16, frozenset({Kernel.ARRAY_DECODE, Kernel.AXPY, Kernel.NARROW_ROW_DOT}),
                   LlamaFileType.MOSTLY_F16, powerinfer_axpy=True),
        WeightType(Q8_0, Q8_0, frozenset({Kernel.ARRAY_DECODE, Kernel.COMPILED_DECODE, Kernel.AXPY,
                                          Kernel.VNNI_ROW_DOT, Kernel.BF16_MATMUL}), LlamaFileType.MOSTLY_Q8_0),
        WeightType(Q4_0, Q8_0, frozenset({Kernel.ARRAY_DECODE, Kernel.COMPILED_DECODE, Kernel.AXPY,
                                          Kernel.VNNI_ROW_DOT, Kernel.VNNI_GATE_UP, Kernel.INTERLEAVED,
                                          Kernel.BF16_ROW_SUM, Kernel.BF16_MATMUL}),
                   LlamaFileType.MOSTLY_Q4_0, powerinfer_axpy=True),
        # q4_1 and q5_1 blocks carry a minimum besides the scale: vec_dot wants x with its block sums (q8_1)
        WeightType(Q4_1, Q8_1, _GGML_QUANTIZED),
        WeightType(Q5_0, Q8_0, _GGML_QUANTIZED),
        WeightType(Q5_1, Q8_1, _GGML_QUANTIZED),
        WeightType(Q4_K, Q8_K, _KQUANT_VNNI),
        WeightType(Q5_K, Q8_K, _GGML_QUANTIZED),
        WeightType(Q6_K, Q8_K, _GGML_QUANTIZED),  # ggml's vec_dot keeps up with memory (docs/lab/kernels.md)
        # Q3_K_M's and Q2_K's k-quants; IQ4_XS, and IQ4_NL (where an IQ4_XS file's rows are not whole 256-value blocks)
        WeightType(Q2_K, Q8_K, _GGML_QUANTIZED),
        WeightType(Q3_K, Q8_K, _GGML_QUANTIZED),
        WeightType(IQ4_NL, Q8_0, _GGML_QUANTIZED),
        WeightType(IQ4_XS, Q8_K, _GGML_QUANTIZED),
        WeightType(IQ3_S, Q8_K, _GGML_QUANTIZED),  # IQ3_S and IQ3_M files
        WeightType(TQ1_0, Q8_K, _GGML_QUANTIZED),  # ternary weights (BitNet b1.58, TriLM)
        WeightType(TQ2_0, Q8_K, _GGML_QUANTIZED),
        # a full-precision download's; vec_dot takes x rounded to bfloat16, and bfloat16 products keep it exactly
        WeightType(BF16, BF16, frozenset({Kernel.BF16_MATMUL})),
    )
}


def types_with(kernel: Kernel, rows: Mapping[GGMLQuantizationType, WeightType] = WEIGHT_TYPES
               ) -> tuple[GGMLQuantizationType, ...]:
    """The types whose rows claim ``kernel``, in the table's order."""
    return tuple(qtype for qtype, t in rows.items() if t.has(kernel))


def check_claims(kernel: Kernel, implemented: Collection[GGMLQuantizationType], where: str,
                 rows: Mapping[GGMLQuantizationType, WeightType] = WEIGHT_TYPES) -> None:
    """Raise ``KernelClaimError`` where a row claims ``kernel`` for a type outside ``implemented``, the types its
    module ``where`` has code for: run by that module at its import."""
    lacking = [rows[qtype].name for qtype in types_with(kernel, rows) if qtype not in implemented]
    if lacking:
        raise KernelClaimError(f"formats/weight_types.py: {', '.join(lacking)} claim{'s' * (len(lacking) == 1)} "
                               f"the {kernel.value}, which {where} has no implementation for")


Implementation = TypeVar("Implementation")


def implementations(kernel: Kernel, implemented: Mapping[GGMLQuantizationType, Implementation], where: str,
                    rows: Mapping[GGMLQuantizationType, WeightType] = WEIGHT_TYPES
                    ) -> dict[GGMLQuantizationType, Implementation]:
    """``kernel``'s implementation for each type whose row claims it, of those its module ``where`` has
    (``implemented``, by type): the table the module dispatches through, built once at its import
    (``check_claims``). An implementation no row claims is left out: the block decoders of ``numba_kernels``
    serve the axpy and the compiled decoder, which f32 and f16 do not claim."""
    check_claims(kernel, implemented, where, rows)
    return {qtype: implemented[qtype] for qtype in types_with(kernel, rows)}
