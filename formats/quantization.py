"""Which GGML type each tensor is stored as, and the reference (de)quantizers behind them.

The output types are those of ``formats/weight_types.py`` that record a llama.cpp file
type: f32, f16, q8_0 and q4_0. Quantization and dequantization are gguf-py's reference
implementations (``gguf.quants``), which reproduce ggml's bit for bit.

The per-tensor policy follows llama.cpp (``convert_hf_to_gguf.py`` and
``llama-quant.cpp``) so that a file we write is what llama.cpp would have made:

* 1-D tensors (norms, biases) and ``*_norm.weight`` stay f32;
* learned position embeddings stay f32 (llama.cpp never quantizes them);
* a quantized type needs rows that are a whole number of 32-value blocks:
  tensors whose rows are not fall back to f16;
* with q4_0 the output projection (the token embedding when there is no
  separate output tensor, as in OPT) is kept at q8_0: llama-quantize keeps it
  at q6_K (which the runtime reads but we do not write), because the logits
  are the most quantization-sensitive product of the model.

Predictors (``blk.N.fc1`` / ``blk.N.fc2``) have their own types, ``PREDICTOR_TYPES``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from gguf import MODEL_TENSOR, TENSOR_NAMES, GGMLQuantizationType, LlamaFileType
from gguf.quants import quant_shape_to_byte_shape, quantize

from powerinfer_tools.formats.constants import POWERINFER_TENSOR_NAMES, PowerInferTensor
from powerinfer_tools.formats.weight_types import F16, F32, Q4_0, Q8_0, WEIGHT_TYPES


@dataclass(frozen=True)
class OutType:
    """One ``--outtype``: the type of most 2-D weights and the file type llama.cpp records for it."""

    name: str
    weight_type: GGMLQuantizationType
    file_type: LlamaFileType


OUTTYPES = {t.name: OutType(t.name, t.qtype, t.file_type)
            for t in WEIGHT_TYPES.values() if t.file_type is not None}  # f32, f16, q8_0, q4_0


# The types of the predictors (fc1, fc2) by the file's weight type. PowerInfer's quantizer stores both
# as q4_0 in a q4_0 model and q5_0 otherwise; q8_0 keeps held-out recall within 0.1 points of float32
# at 53% of f16's bytes, and has kernels of our own (q5_0 only ggml's vec_dot) (docs/lab/kernels.md,
# "Predictors"). In a q4_0 file fc1 is q4_0 too, but fc2 stays q8_0: a q4_0 fc2 cost 0.5-1.0 points
# of recall (below the training target, which is measured in float32), q8_0 0.1 at most, for 1.65x
# the predictor bytes (~1% of a sparse token's). PowerInfer's runtime computes them with ggml_mul_mat,
# which takes any of these (its own convert.py writes q8_0 predictors). An f32 file is the unrounded
# one: everything stays f32.
PREDICTOR_TYPES = {F32: (F32, F32), F16: (Q8_0, Q8_0), Q8_0: (Q8_0, Q8_0), Q4_0: (Q4_0, Q8_0)}


def _block_weight_pattern(template: str) -> re.Pattern:
    """A block tensor's weight name in any layer, an expert's too: ``blk.{bid}.fc1`` matches
    ``blk.7.fc1.weight`` and ``blk.7.fc1.3.weight``."""
    return re.compile(re.escape(template).replace(re.escape("{bid}"), r"\d+") + r"(\.\d+)?\.weight")


_PREDICTOR_NAMES = [_block_weight_pattern(POWERINFER_TENSOR_NAMES[t])  # fc1, fc2
                    for t in (PowerInferTensor.PREDICTOR_FC1, PowerInferTensor.PREDICTOR_FC2)]
# A mixture's router stays f32, as llama.cpp's converter and quantizer keep it: a few KB per layer
# whose rounding would move tokens between experts.
_ROUTER_NAME = _block_weight_pattern(TENSOR_NAMES[MODEL_TENSOR.FFN_GATE_INP])


def tensor_type(name: str, shape: tuple[int, ...], outtype: OutType, *, is_output: bool) -> GGMLQuantizationType:
    """The type tensor ``name`` (GGUF name, NumPy-order ``shape``) is stored as.

    ``is_output`` marks the tensor that computes the logits (``output.weight``,
    or ``token_embd.weight`` when the model has no separate output tensor).
    """
    if len(shape) < 2 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return F32
    if name.startswith("position_embd.") or _ROUTER_NAME.fullmatch(name):
        return F32
    wanted = outtype.weight_type
    for part, pattern in enumerate(_PREDICTOR_NAMES):
        if pattern.fullmatch(name):
            wanted = PREDICTOR_TYPES[wanted][part]
    if wanted is Q4_0 and is_output:
        wanted = Q8_0
    if shape[-1] % WEIGHT_TYPES[wanted].block_size != 0:
        return F16
    return wanted


def storage_shape(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> tuple[tuple[int, ...], np.dtype]:
    """How a tensor of element ``shape`` is laid out as a NumPy array: f32/f16 as floats,
    block-quantized types as ``uint8`` rows of blocks (the layout ``gguf.quants`` uses)."""
    if qtype is F32:
        return shape, np.dtype(np.float32)
    if qtype is F16:
        return shape, np.dtype(np.float16)
    return quant_shape_to_byte_shape(shape, qtype), np.dtype(np.uint8)


def encode(rows: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Float32 rows in the storage layout of ``qtype`` (gguf's reference quantizer)."""
    return quantize(np.asarray(rows, dtype=np.float32), qtype)


def decode(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Stored data back to float32 (gguf's reference dequantizer)."""
    return WEIGHT_TYPES[qtype].dequantize(data)
