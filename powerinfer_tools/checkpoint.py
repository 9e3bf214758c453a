"""Hugging Face checkpoints on disk: config.json plus memory-mapped safetensors.

Tensors are never read eagerly: each one is a read-only ``np.memmap`` view into
its file (bf16 is widened to float32 on access, since NumPy has no bfloat16), so
the converter streams a checkpoint one tensor at a time and a model larger than
RAM can still be opened. The safetensors header is parsed here rather than
through ``safetensors.safe_open`` because its NumPy backend rejects bf16 and
copies tensors instead of mapping them.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from .errors import PitoolsError
from .fileio import read_json

# safetensors dtype names -> NumPy storage dtypes. BF16 is stored as uint16.
_STORAGE_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, byte range, dtype and shape."""

    name: str
    path: Path
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def bf16_to_float32(raw: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bit patterns (uint16) to float32 exactly."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one .safetensors file's header and check it against the file size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise PitoolsError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise PitoolsError(f"{path}: corrupt or truncated safetensors file (header length {header_len} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PitoolsError(f"{path}: corrupt safetensors header ({exc})") from None
    data_start = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise PitoolsError(f"{path}: corrupt safetensors header entry for tensor {name!r}") from None
        if dtype not in _STORAGE_DTYPES:
            raise PitoolsError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(_STORAGE_DTYPES[dtype]).itemsize
        if end - begin != expected or begin < 0:
            raise PitoolsError(f"{path}: tensor {name!r} has {end - begin} bytes, its shape {list(shape)} needs {expected}")
        if data_start + end > size:
            raise PitoolsError(
                f"{path}: truncated safetensors file: tensor {name!r} ends at byte {data_start + end}, file has {size}"
            )
        tensors[name] = TensorInfo(name, path, dtype, shape, data_start + begin, end - begin)
    return tensors


class Checkpoint:
    """A checkpoint folder: ``config.json`` and one or more ``*.safetensors`` files."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise PitoolsError(f"{self.folder}: not a checkpoint folder")
        self.config = self._read_config()
        self._tensors = self._index_tensors()

    def _read_config(self) -> dict:
        path = self.folder / "config.json"
        if not path.is_file():
            raise PitoolsError(f"{self.folder}: no config.json; is this a Hugging Face checkpoint folder?")
        return read_json(path)

    def _shard_paths(self) -> list[Path]:
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise PitoolsError(f"{index}: invalid safetensors index ({exc})") from None
            paths = [self.folder / name for name in sorted(set(weight_map.values()))]
            missing = [p.name for p in paths if not p.is_file()]
            if missing:
                raise PitoolsError(f"{index}: names shard(s) that are missing: {', '.join(missing)}")
            return paths
        paths = sorted(self.folder.glob("*.safetensors"))
        if not paths:
            bins = sorted(self.folder.glob("*.bin"))
            hint = " (only PyTorch .bin weights; re-save them with safetensors)" if bins else ""
            raise PitoolsError(f"{self.folder}: no *.safetensors weights found{hint}")
        return paths

    def _index_tensors(self) -> dict[str, TensorInfo]:
        tensors: dict[str, TensorInfo] = {}
        for path in self._shard_paths():
            tensors.update(read_safetensors_header(path))
        return tensors

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise PitoolsError(f"{self.folder}: checkpoint has no tensor {name!r}") from None

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored, memory-mapped read-only (bf16 as uint16 bit patterns)."""
        info = self.info(name)
        if info.nbytes == 0:  # np.memmap cannot map an empty range
            return np.empty(info.shape, dtype=_STORAGE_DTYPES[info.dtype])
        return np.memmap(info.path, dtype=_STORAGE_DTYPES[info.dtype], mode="r", offset=info.offset, shape=info.shape)

    def tensor(self, name: str, dtype=np.float32) -> np.ndarray:
        """The tensor as ``dtype``: a zero-copy view when it is already stored so, else a converted copy."""
        info = self.info(name)
        raw = self.raw(name)
        if info.dtype == "BF16":
            raw = bf16_to_float32(raw)
        return raw if raw.dtype == dtype else raw.astype(dtype)
