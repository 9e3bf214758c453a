"""PowerInfer's GPU split file (``<model>.generated.gpuidx``): which FFN neurons live on the GPU.

The layout is PowerInfer's (``powerinfer-py/powerinfer/export_split.py`` writes it, the
``llama_gpu_split_loader`` of its ``llama.cpp`` reads it): a GGUF file of architecture
``generic.gpu_index`` whose first 8 bytes are then overwritten with the magic ``PWRI`` and the
version 3; per layer ``l``, in this order, tensors ``blk.l.gpu_idx`` (int32 0/1 over the
layer's neurons) and ``blk.l.gpu_bucket`` (sorted int32 ids of the GPU neurons); keys
``generic.gpu_index.block_count`` and ``split.vram_capacity`` (uint64). The runtime finds the
tensors by position (``2l`` and ``2l + 1``), so the order matters, and it refuses a file
with other tensors. Extra keys are ignored by it, which is where ours go (``pitools.*``):
those our runtime acts on are ``GpuSplit``'s typed fields, the rest its ``notes``. So is the RAM
tier of ``pitools solve --ram``: each layer's RAM-resident neurons as a key of sorted ids.
See formats/README.md.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from powerinfer_tools.formats.constants import (
    CACHE_BYTES_KEY,
    DENSE_ON_GPU_KEY,
    GPU_INDEX_ARCHITECTURE,
    MODEL_FINGERPRINT_KEY,
    OUTPUT_ON_GPU_KEY,
    POWERINFER_MAGIC_BYTES,
    RAM_BUDGET_KEY,
    VRAM_BUDGET_KEY,
    VRAM_CAPACITY_KEY,
    PowerInferTensor,
    ram_neurons_key,
    tensor_base_name,
)
from powerinfer_tools.formats.metadata_keys import LAYERS, SPLIT_KEYS, check_metadata
from powerinfer_tools.formats.model_file import open_model_file

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.fileio import atomic_output

POWERINFER_VERSION = 3
BLOCK_COUNT_KEY = gguf.Keys.LLM.BLOCK_COUNT.format(arch=GPU_INDEX_ARCHITECTURE)
_STANDARD_KEYS = {gguf.Keys.General.ARCHITECTURE, BLOCK_COUNT_KEY, VRAM_CAPACITY_KEY}
SPLIT_SUFFIX = ".generated.gpuidx"  # PowerInfer's runtime looks for <model>.generated.gpuidx


def default_split_path(model_path: Path) -> Path:
    """Where PowerInfer looks for a model's split file: beside it, ``.generated.gpuidx`` appended."""
    return model_path.with_name(model_path.name + SPLIT_SUFFIX)


@dataclass(frozen=True, eq=False)
class GpuSplit:
    masks: tuple[np.ndarray, ...]  # per layer: bool over its FFN neurons, True = on the GPU
    vram_capacity: int  # bytes the runtime must have free for the FFN rows of this split
    # Ours, absent (None) in PowerInfer's files: what the solver decided beyond the masks.
    vram_budget: int | None = None  # the whole VRAM budget the split was solved for
    dense_on_gpu: tuple[bool, ...] | None = None  # per layer: its dense block (attention, norms) on the GPU
    output_on_gpu: bool | None = None  # the head (output norm and matrix) on the GPU
    model_fingerprint: str | None = None  # formats.fingerprint.model_fingerprint of the model solved for
    notes: Mapping[str, Any] = field(default_factory=dict)  # other keys, for people: objective, predictions
    # The RAM tier (pitools solve --ram); None without one. Neurons in neither mask are on disk behind the cache.
    ram_masks: tuple[np.ndarray, ...] | None = None  # per layer: bool over its neurons, True = resident in RAM
    ram_budget: int | None = None  # the whole RAM budget the split was solved for, bytes
    cache_bytes: int | None = None  # the neuron cache the solver planned, bytes (the same slots in every layer)

    def __post_init__(self) -> None:
        if self.ram_masks is None:
            return
        if self.ram_budget is None and self.cache_bytes is None:
            raise ValueError("a RAM tier is stored with its ram_budget or cache_bytes, which mark it in the file")
        if len(self.ram_masks) != len(self.masks):
            raise ValueError(f"{len(self.ram_masks)} RAM masks for {len(self.masks)} layers")
        for layer, (gpu, ram) in enumerate(zip(self.masks, self.ram_masks)):
            if ram.shape != gpu.shape or (ram & gpu).any():
                raise ValueError(f"layer {layer}: a RAM mask has its GPU mask's length and none of its neurons")

    def bucket(self, layer: int) -> np.ndarray:
        """Sorted ids of the GPU neurons of ``layer``, as the file stores them."""
        return np.flatnonzero(self.masks[layer]).astype(np.int32)

    @property
    def extra(self) -> dict[str, Any]:
        """Every key outside PowerInfer's format, as the file stores it: the typed fields and the notes."""
        typed = {
            VRAM_BUDGET_KEY: self.vram_budget,
            DENSE_ON_GPU_KEY: None if self.dense_on_gpu is None else list(self.dense_on_gpu),
            OUTPUT_ON_GPU_KEY: self.output_on_gpu,
            MODEL_FINGERPRINT_KEY: self.model_fingerprint,
            RAM_BUDGET_KEY: self.ram_budget,
            CACHE_BYTES_KEY: self.cache_bytes,
        }
        if self.ram_masks is not None:  # a layer without RAM neurons has no key (GGUF arrays are not empty)
            typed.update({ram_neurons_key(layer): self.ram_neurons(layer) for layer in range(len(self.ram_masks))
                          if self.ram_masks[layer].any()})
        return {**self.notes, **{key: value for key, value in typed.items() if value is not None}}

    def ram_neurons(self, layer: int) -> np.ndarray:
        """Sorted ids of the RAM-resident neurons of ``layer``, as the file stores them."""
        return np.flatnonzero(self.ram_masks[layer]).astype(np.int32)


def _from_extra(masks: tuple[np.ndarray, ...], vram_capacity: int, extra: dict[str, Any], path) -> GpuSplit:
    """The split of a file's keys (their values checked against ``SPLIT_KEYS``): ours that the runtime acts on
    become typed fields, the rest notes."""
    dense = extra.pop(DENSE_ON_GPU_KEY, None)
    ram_budget, cache_bytes = extra.pop(RAM_BUDGET_KEY, None), extra.pop(CACHE_BYTES_KEY, None)
    return GpuSplit(
        masks,
        vram_capacity,
        vram_budget=extra.pop(VRAM_BUDGET_KEY, None),
        dense_on_gpu=None if dense is None else tuple(dense),
        output_on_gpu=extra.pop(OUTPUT_ON_GPU_KEY, None),
        model_fingerprint=extra.pop(MODEL_FINGERPRINT_KEY, None),
        ram_masks=_ram_masks(path, masks, extra, has_tier=ram_budget is not None or cache_bytes is not None),
        ram_budget=ram_budget,
        cache_bytes=cache_bytes,
        notes=extra,
    )


def _ram_masks(path, masks: tuple[np.ndarray, ...], extra: dict[str, Any], has_tier: bool) -> tuple[np.ndarray, ...] | None:
    """The RAM masks of a file's ``ram_neurons_key`` keys (popped from ``extra``), checked: sorted ids of
    neurons not on the GPU. None for a file without a RAM tier (neither ``RAM_BUDGET_KEY`` nor ``CACHE_BYTES_KEY``)."""
    stored = {layer: extra.pop(ram_neurons_key(layer)) for layer in range(len(masks)) if ram_neurons_key(layer) in extra}
    if not has_tier:
        if stored:
            raise PitoolsError(f"{path}: {ram_neurons_key(min(stored))} without {RAM_BUDGET_KEY} or {CACHE_BYTES_KEY}")
        return None
    return tuple(_ram_mask(path, layer, stored.get(layer, []), gpu) for layer, gpu in enumerate(masks))


def _ram_mask(path, layer: int, stored: Any, gpu: np.ndarray) -> np.ndarray:
    ids = np.asarray(stored)
    if not (ids.ndim == 1 and (ids.size == 0 or (np.issubdtype(ids.dtype, np.integer) and ids[0] >= 0
                                                 and ids[-1] < len(gpu) and (np.diff(ids) > 0).all()))):
        raise PitoolsError(f"{path}: {ram_neurons_key(layer)} is not a sorted list of distinct neuron ids below "
                           f"{len(gpu)}")
    mask = np.zeros(len(gpu), dtype=bool)
    mask[ids.astype(np.int64)] = True
    if (mask & gpu).any():
        raise PitoolsError(f"{path}: {ram_neurons_key(layer)} names neurons that are also on the GPU")
    return mask


def _add_extra(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    # GGUF scalars are typed; pick the type from the Python value.
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, (bool, np.bool_)):
        writer.add_bool(key, bool(value))
    elif isinstance(value, (int, np.integer)) and value >= 0:
        writer.add_uint64(key, int(value))
    elif isinstance(value, (int, np.integer)):
        writer.add_int64(key, int(value))
    elif isinstance(value, (float, np.floating)):
        writer.add_float64(key, float(value))
    elif isinstance(value, (Sequence, np.ndarray)) and len(value):
        # gguf infers an array's element type from its first item (bool, int32 or float32).
        writer.add_array(key, [v.item() if isinstance(v, np.generic) else v for v in value])
    else:
        raise TypeError(f"split file key {key}: cannot store {value!r}")


def write_gpu_split(path: str | Path, split: GpuSplit, overwrite: bool = True) -> None:
    """Write ``split`` atomically: a crash never leaves a half-written file for the runtime."""
    with atomic_output(path, overwrite=overwrite) as tmp:
        writer = gguf.GGUFWriter(tmp, GPU_INDEX_ARCHITECTURE)
        for layer, mask in enumerate(split.masks):
            writer.add_tensor(_idx_name(layer), mask.astype(np.int32))
            writer.add_tensor(_bucket_name(layer), split.bucket(layer))
        writer.add_block_count(len(split.masks))
        writer.add_uint64(VRAM_CAPACITY_KEY, split.vram_capacity)
        for key, value in split.extra.items():
            _add_extra(writer, key, value)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with open(tmp, "r+b") as f:
            f.write(POWERINFER_MAGIC_BYTES + struct.pack("<I", POWERINFER_VERSION))


def read_gpu_split(path: str | Path) -> GpuSplit:
    """Read a split file written by us or by PowerInfer (magic ``PWRI`` or plain ``GGUF``)."""
    file = open_model_file(path)
    fields = file.metadata
    if file.architecture != GPU_INDEX_ARCHITECTURE:
        raise PitoolsError(
            f"{path}: architecture {file.architecture!r}, expected {GPU_INDEX_ARCHITECTURE!r} (a GPU split file)"
        )
    if VRAM_CAPACITY_KEY not in fields:
        raise PitoolsError(f"{path}: no {VRAM_CAPACITY_KEY} key, which PowerInfer's loader requires")
    tensors = list(file.tensors.values())  # in file order: the runtime reads them by position
    n_layers = len(tensors) // 2
    if len(tensors) % 2 or fields.get(BLOCK_COUNT_KEY, n_layers) != n_layers:
        raise PitoolsError(f"{path}: {len(tensors)} tensors for {fields.get(BLOCK_COUNT_KEY)} layers")
    check_metadata(path, fields, SPLIT_KEYS, counts={LAYERS: n_layers})  # the layers are the tensors'
    masks = []
    for layer in range(n_layers):
        idx, bucket = tensors[2 * layer], tensors[2 * layer + 1]
        if (idx.name, bucket.name) != (_idx_name(layer), _bucket_name(layer)):
            raise PitoolsError(f"{path}: tensors {2 * layer} and {2 * layer + 1} are {idx.name}, {bucket.name}")
        mask = np.asarray(idx.data)
        if not np.isin(mask, (0, 1)).all():
            raise PitoolsError(f"{path}: {idx.name} holds values other than 0 and 1")
        if not np.array_equal(np.flatnonzero(mask), np.asarray(bucket.data)):
            raise PitoolsError(f"{path}: {bucket.name} is not the sorted list of the neurons {idx.name} marks")
        masks.append(mask.astype(bool))
    ours = {key: value for key, value in fields.items() if key not in _STANDARD_KEYS}
    return _from_extra(tuple(masks), fields[VRAM_CAPACITY_KEY], ours, path)


def _idx_name(layer: int) -> str:
    return tensor_base_name(PowerInferTensor.GPU_IDX, layer)  # no .weight: the split file names them so


def _bucket_name(layer: int) -> str:
    return tensor_base_name(PowerInferTensor.GPU_BUCKET, layer)
