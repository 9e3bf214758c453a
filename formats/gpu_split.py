"""PowerInfer's GPU split file (``<model>.generated.gpuidx``): which FFN neurons live on the GPU.

The layout is PowerInfer's (``powerinfer-py/powerinfer/export_split.py`` writes it, the
``llama_gpu_split_loader`` of its ``llama.cpp`` reads it): a GGUF file of architecture
``generic.gpu_index`` whose first 8 bytes are then overwritten with the magic ``PWRI`` and the
version 3; per layer ``l``, in this order, tensors ``blk.l.gpu_idx`` (int32 0/1 over the
layer's neurons) and ``blk.l.gpu_bucket`` (sorted int32 ids of the GPU neurons); keys
``generic.gpu_index.block_count`` and ``split.vram_capacity`` (uint64). The runtime finds the
tensors by position (``2l`` and ``2l + 1``), so the order matters, and it refuses a file
with other tensors. Extra keys are ignored by it, which is where ours go (``pitools.*``).
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

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.fileio import atomic_output

from .model_file import POWERINFER_MAGIC_BYTES, open_model_file

ARCHITECTURE = "generic.gpu_index"
POWERINFER_VERSION = 3
VRAM_CAPACITY_KEY = "split.vram_capacity"
BLOCK_COUNT_KEY = f"{ARCHITECTURE}.block_count"
# Ours: which model file the split was solved for (formats.fingerprint.model_fingerprint of it).
MODEL_FINGERPRINT_KEY = "pitools.model_fingerprint"
_STANDARD_KEYS = {"general.architecture", BLOCK_COUNT_KEY, VRAM_CAPACITY_KEY}


@dataclass(frozen=True, eq=False)
class GpuSplit:
    masks: tuple[np.ndarray, ...]  # per layer: bool over its FFN neurons, True = on the GPU
    vram_capacity: int  # bytes the runtime must have free for the FFN rows of this split
    extra: Mapping[str, Any] = field(default_factory=dict)  # keys outside PowerInfer's format

    def bucket(self, layer: int) -> np.ndarray:
        """Sorted ids of the GPU neurons of ``layer``, as the file stores them."""
        return np.flatnonzero(self.masks[layer]).astype(np.int32)


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


def write_gpu_split(path: str | Path, split: GpuSplit) -> None:
    """Write ``split`` atomically: a crash never leaves a half-written file for the runtime."""
    with atomic_output(path) as tmp:
        writer = gguf.GGUFWriter(tmp, ARCHITECTURE)
        for layer, mask in enumerate(split.masks):
            writer.add_tensor(f"blk.{layer}.gpu_idx", mask.astype(np.int32))
            writer.add_tensor(f"blk.{layer}.gpu_bucket", split.bucket(layer))
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
    if file.architecture != ARCHITECTURE:
        raise PitoolsError(f"{path}: architecture {file.architecture!r}, expected {ARCHITECTURE!r} (a GPU split file)")
    if VRAM_CAPACITY_KEY not in fields:
        raise PitoolsError(f"{path}: no {VRAM_CAPACITY_KEY} key, which PowerInfer's loader requires")
    tensors = list(file.tensors.values())  # in file order: the runtime reads them by position
    n_layers = len(tensors) // 2
    if len(tensors) % 2 or fields.get(BLOCK_COUNT_KEY, n_layers) != n_layers:
        raise PitoolsError(f"{path}: {len(tensors)} tensors for {fields.get(BLOCK_COUNT_KEY)} layers")
    masks = []
    for layer in range(n_layers):
        idx, bucket = tensors[2 * layer], tensors[2 * layer + 1]
        if (idx.name, bucket.name) != (f"blk.{layer}.gpu_idx", f"blk.{layer}.gpu_bucket"):
            raise PitoolsError(f"{path}: tensors {2 * layer} and {2 * layer + 1} are {idx.name}, {bucket.name}")
        mask = np.asarray(idx.data)
        if not np.isin(mask, (0, 1)).all():
            raise PitoolsError(f"{path}: {idx.name} holds values other than 0 and 1")
        if not np.array_equal(np.flatnonzero(mask), np.asarray(bucket.data)):
            raise PitoolsError(f"{path}: {bucket.name} is not the sorted list of the neurons {idx.name} marks")
        masks.append(mask.astype(bool))
    return GpuSplit(
        masks=tuple(masks),
        vram_capacity=int(fields[VRAM_CAPACITY_KEY]),
        extra={key: value for key, value in fields.items() if key not in _STANDARD_KEYS},
    )
