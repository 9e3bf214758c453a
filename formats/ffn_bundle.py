"""The bundled FFN layout: a neuron's rows of ``ffn_gate``, ``ffn_up`` and ``ffn_down_t`` side by side.

A neuron that the runtime reads from disk (the neuron cache of ``pitools run --ram``) needs one row of
each of the three matrices. In PowerInfer's layout they lie in three tensors far apart: three reads.
Bundled, as PowerInfer-2 and Apple's "LLM in a flash" do (row-column bundling), they are one row of
``blk.N.ffn_bundle`` (GGML ``I8``, ``[d_ff, stride]`` bytes): gate row n's stored bytes, then up row n's,
then ``ffn_down_t`` row n's, then zeros up to ``stride``: a multiple of ``direct_io.ALIGNMENT`` (4096),
or for rows smaller than that a power of two. The file's ``general.alignment`` is that alignment, so
no row straddles an aligned block: one direct read of one block (or of a row's own blocks) gets it. Which tensors a row holds, their GGML types and
the stride are in three ``pitools.ffn_bundle.*`` keys (an ungated FFN bundles up and down only).
Biases, predictors and every other tensor stay as they are. PowerInfer's runtime cannot read the
layout; ``pitools bundle`` (``conversion/bundle.py``) writes it from a PowerInfer file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from gguf import MODEL_TENSOR, GGMLQuantizationType, GGUFWriter
from powerinfer_tools.formats.constants import (
    FFN_BUNDLE_PARTS_KEY,
    FFN_BUNDLE_STRIDE_KEY,
    FFN_BUNDLE_TYPES_KEY,
    PowerInferTensor,
    TensorKind,
    block_part,
)
from powerinfer_tools.formats.model_file import ModelFile
from powerinfer_tools.formats.quantization import storage_shape

from powerinfer_tools.direct_io import ALIGNMENT
from powerinfer_tools.errors import PitoolsError

# The tensors a bundle row may hold, in row order.
BUNDLED_TENSORS: tuple[TensorKind, ...] = (MODEL_TENSOR.FFN_GATE, MODEL_TENSOR.FFN_UP, PowerInferTensor.FFN_DOWN_T)
_BY_PART = {block_part(t): t for t in BUNDLED_TENSORS}


@dataclass(frozen=True)
class BundlePart:
    tensor: TensorKind
    qtype: GGMLQuantizationType
    offset: int  # where its bytes start in a bundle row
    nbytes: int  # one stored row of it


@dataclass(frozen=True)
class BundleLayout:
    parts: tuple[BundlePart, ...]
    stride: int  # bytes per bundle row: the parts, then zeros (``bundle_stride``)

    @classmethod
    def plan(cls, parts: Sequence[tuple[TensorKind, GGMLQuantizationType, int]]) -> BundleLayout:
        """The layout of ``(tensor, type, row bytes)`` in that order, padded to ``ALIGNMENT``."""
        placed, offset = [], 0
        for tensor, qtype, nbytes in parts:
            placed.append(BundlePart(tensor, GGMLQuantizationType(qtype), offset, int(nbytes)))
            offset += int(nbytes)
        return cls(tuple(placed), bundle_stride(offset))

    @classmethod
    def of_file(cls, model: ModelFile) -> BundleLayout | None:
        """The layout a bundled file declares, checked; None for any other file."""
        names, types, stride = (model.get(key) for key in (FFN_BUNDLE_PARTS_KEY, FFN_BUNDLE_TYPES_KEY,
                                                           FFN_BUNDLE_STRIDE_KEY))
        if names is None and types is None and stride is None:
            return None
        # Their types, and as many types as parts, were checked as the file was opened (formats/metadata_keys.py).
        if names is None or types is None or stride is None or not names or not all(n in _BY_PART for n in names):
            raise PitoolsError(f"{model.path}: malformed bundled-layout keys {FFN_BUNDLE_PARTS_KEY}, "
                               f"{FFN_BUNDLE_TYPES_KEY}, {FFN_BUNDLE_STRIDE_KEY}")
        try:
            qtypes = [GGMLQuantizationType(t) for t in types]
        except ValueError:
            raise PitoolsError(f"{model.path}: {FFN_BUNDLE_TYPES_KEY} holds an unknown GGML type: {types}") from None
        return cls.checked(model, [_BY_PART[n] for n in names], qtypes, stride)

    @classmethod
    def checked(cls, model: ModelFile, tensors: list, qtypes: list, stride: int) -> BundleLayout:
        """The layout of ``tensors`` of ``qtypes`` with rows of ``d_model`` elements, if ``stride`` fits it."""
        d_model = model.get("{arch}.embedding_length")
        if not isinstance(d_model, int):
            raise PitoolsError(f"{model.path}: bundled layout in a file without {{arch}}.embedding_length")
        rows = [storage_row_bytes(q, d_model) for q in qtypes]
        layout = cls.plan(list(zip(tensors, qtypes, rows)))
        if stride != layout.stride:
            raise PitoolsError(f"{model.path}: {FFN_BUNDLE_STRIDE_KEY} is {stride}; rows of {d_model} elements of "
                               f"{', '.join(q.name for q in qtypes)} need {layout.stride}")
        return layout

    def add_to(self, writer: GGUFWriter) -> None:
        writer.add_custom_alignment(ALIGNMENT)  # every bundle row at an aligned file offset
        writer.add_array(FFN_BUNDLE_PARTS_KEY, [block_part(p.tensor) for p in self.parts])
        writer.add_array(FFN_BUNDLE_TYPES_KEY, [int(p.qtype) for p in self.parts])
        writer.add_uint32(FFN_BUNDLE_STRIDE_KEY, self.stride)

    def part(self, tensor: TensorKind) -> BundlePart | None:
        return next((p for p in self.parts if p.tensor == tensor), None)

    def view(self, bundle: np.ndarray, part: BundlePart, cols: int) -> np.ndarray:
        """``part``'s rows inside ``bundle`` (``[n, stride]`` bytes), as its stored type's array (a strided view)."""
        shape, dtype = storage_shape((bundle.shape[0], cols), part.qtype)
        raw = bundle.view(np.uint8)[:, part.offset : part.offset + part.nbytes]
        return raw if dtype == np.uint8 else raw.view(dtype).reshape(shape)

    def pack(self, rows: dict[TensorKind, np.ndarray]) -> np.ndarray:
        """Bundle rows (int8 ``[n, stride]``) from each part's stored rows."""
        n = len(next(iter(rows.values())))
        out = np.zeros((n, self.stride), dtype=np.uint8)
        for p in self.parts:
            out[:, p.offset : p.offset + p.nbytes] = np.ascontiguousarray(rows[p.tensor]).view(np.uint8).reshape(n, -1)
        return out.view(np.int8)


def bundle_stride(nbytes: int) -> int:
    """Bytes from one bundle row to the next: ``nbytes`` rounded up to a power of two below ``ALIGNMENT``,
    to a multiple of it above, so that no row straddles an aligned block and one direct read gets it."""
    if nbytes >= ALIGNMENT:
        return -(-nbytes // ALIGNMENT) * ALIGNMENT
    return 1 << max(0, nbytes - 1).bit_length()


def storage_row_bytes(qtype: GGMLQuantizationType, cols: int) -> int:
    """Bytes of one stored row of ``cols`` elements of ``qtype``."""
    shape, dtype = storage_shape((1, cols), qtype)
    return int(shape[-1]) * dtype.itemsize
