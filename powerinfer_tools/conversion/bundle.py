"""Rewriting a PowerInfer file in the bundled FFN layout (``formats/ffn_bundle.py``).

Every tensor and key is copied as stored, except that each layer's ``ffn_gate``, ``ffn_up`` and
``ffn_down_t`` become one ``ffn_bundle`` tensor, written where the first of them was; nothing is
re-quantized, so the bundled file computes exactly what its source computes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from powerinfer_tools.conversion.convert import POWERINFER_SUFFIX
from powerinfer_tools.formats.constants import PowerInferTensor, block_part, tensor_name
from powerinfer_tools.formats.ffn_bundle import BUNDLED_TENSORS, BundleLayout
from powerinfer_tools.formats.model_check import check_model_tensors
from powerinfer_tools.formats.model_file import CopiedTensor, ModelFile, ModelFileWriter, copy_metadata, open_model_file
from powerinfer_tools.models import spec_from_model_file

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.fileio import atomic_output, check_writable_output


def bundled_path(model: Path) -> Path:
    """``x.powerinfer.gguf`` -> ``x.bundled.powerinfer.gguf`` (any other name: ``.bundled`` before its suffix)."""
    name = model.name
    for suffix in (POWERINFER_SUFFIX, model.suffix):
        if suffix and name.endswith(suffix):
            return model.with_name(name[: -len(suffix)] + ".bundled" + suffix)
    return model.with_name(name + ".bundled")


def bundled_layout(model: ModelFile, n_layers: int) -> BundleLayout:
    """The layout of ``model``'s FFN rows, one type per bundled tensor across layers (as converted files have)."""
    if BundleLayout.of_file(model) is not None:
        raise PitoolsError(f"{model.path}: already in the bundled layout")
    present = [t for t in BUNDLED_TENSORS if tensor_name(t, 0) in model]
    if tensor_name(PowerInferTensor.FFN_DOWN_T, 0) not in model:
        raise PitoolsError(f"{model.path}: not in PowerInfer's sparse layout (no {block_part(PowerInferTensor.FFN_DOWN_T)}): "
                           "convert it without --dense")
    layout = BundleLayout.plan([(t, model[tensor_name(t, 0)].qtype, model[tensor_name(t, 0)].data[0].nbytes)
                                for t in present])
    for layer in range(n_layers):
        for part in layout.parts:
            if model[tensor_name(part.tensor, layer)].qtype != part.qtype:
                raise PitoolsError(f"{model.path}: {tensor_name(part.tensor, layer)} is "
                                   f"{model[tensor_name(part.tensor, layer)].qtype.name}, layer 0's is {part.qtype.name}: "
                                   "the bundled layout needs one type per tensor kind")
    return layout


def _bundle_tensor(model: ModelFile, layout: BundleLayout, layer: int, d_ff: int) -> CopiedTensor:
    def stored() -> np.ndarray:
        return layout.pack({p.tensor: model[tensor_name(p.tensor, layer)].data for p in layout.parts})

    return CopiedTensor(tensor_name(PowerInferTensor.FFN_BUNDLE, layer), (d_ff, layout.stride),
                        GGMLQuantizationType.I8, stored)


def bundle_model(source: str | Path, output: str | Path, force: bool = False, progress: bool = True) -> BundleLayout:
    """Write ``source`` (a PowerInfer file) to ``output`` in the bundled layout; the layout written."""
    model = open_model_file(source)
    spec = spec_from_model_file(model)
    check_model_tensors(model, spec)
    if spec.moe:
        raise PitoolsError(f"{model.path}: the bundled layout of a mixture of experts is not written yet")
    layout = bundled_layout(model, spec.n_layers)
    output = Path(output)
    check_writable_output(output, force, [model.path])
    replaced = {tensor_name(p.tensor, layer): layer for p in layout.parts for layer in range(spec.n_layers)}
    tensors, done = [], set()
    for name, t in model.tensors.items():
        if name not in replaced:
            tensors.append(CopiedTensor(name, t.shape, t.qtype, lambda t=t: t.data))
        elif replaced[name] not in done:
            done.add(replaced[name])
            tensors.append(_bundle_tensor(model, layout, replaced[name], spec.d_ff))
    with atomic_output(output, overwrite=force) as tmp:
        writer = ModelFileWriter(tmp, model.architecture, model.powerinfer)
        copy_metadata(model, writer.gguf)
        layout.add_to(writer.gguf)
        writer.write(tensors, progress)
    return layout
