"""safetensors files: the header read and checked entry by entry, and tensors memory-mapped.

Tensors are never read eagerly: each one is a read-only ``np.memmap`` view into
its file (bf16 is widened to float32 on access, since NumPy has no bfloat16), so
a checkpoint or a predictor folder streams one tensor at a time and a model
larger than RAM can still be opened. The header is parsed here rather than
through ``safetensors.safe_open`` because its NumPy backend rejects bf16 and
copies tensors instead of mapping them.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from powerinfer_tools.errors import PitoolsError

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
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_MAX_HEADER_BYTES = 100 * 1024 * 1024
_CHUNK_ELEMENTS = 1 << 22  # counted at a time, so a count never holds a whole large tensor


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
    """Parse one .safetensors file's header and check every entry against the file."""
    header, data_start, size = _header_json(path)
    tensors = {
        name: _tensor_info(path, name, entry, data_start, size)
        for name, entry in header.items()
        if name != "__metadata__"
    }
    _check_disjoint(path, list(tensors.values()))
    return tensors


def _header_json(path: Path) -> tuple[dict, int, int]:
    """The parsed JSON header, the offset where tensor data starts, and the file size."""
    if not path.is_file():
        raise PitoolsError(f"{path}: not a regular file; safetensors weights must be files")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise PitoolsError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(size - 8, _MAX_HEADER_BYTES):
                raise PitoolsError(f"{path}: corrupt or truncated safetensors file (header length {header_len} bytes)")
            raw = f.read(header_len)
    except OSError as exc:
        raise PitoolsError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise PitoolsError(f"{path}: corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise PitoolsError(f"{path}: corrupt safetensors header (a JSON {type(header).__name__}, not an object)")
    return header, 8 + header_len, size


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor_info(path: Path, name: str, entry, data_start: int, size: int) -> TensorInfo:
    """One header entry, checked: known dtype, a shape and a byte range that agree, inside the file."""
    if not isinstance(entry, dict):
        raise PitoolsError(f"{path}: corrupt safetensors header entry for tensor {name!r} (not an object)")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _STORAGE_DTYPES:
        raise PitoolsError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
        raise PitoolsError(f"{path}: tensor {name!r} has shape {shape!r}; expected a list of integers >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(n) for n in offsets)
            and offsets[0] <= offsets[1]):
        raise PitoolsError(f"{path}: tensor {name!r} has data_offsets {offsets!r}; expected [begin, end], 0 <= begin <= end")
    begin, end = offsets
    expected = math.prod(shape) * np.dtype(_STORAGE_DTYPES[dtype]).itemsize
    if end - begin != expected:
        raise PitoolsError(f"{path}: tensor {name!r} has {end - begin} bytes, its shape {shape} needs {expected}")
    if data_start + end > size:
        raise PitoolsError(
            f"{path}: truncated safetensors file: tensor {name!r} ends at byte {data_start + end}, file has {size}"
        )
    return TensorInfo(name, path, dtype, tuple(shape), data_start + begin, end - begin)


def _check_disjoint(path: Path, tensors: list[TensorInfo]) -> None:
    """No two tensors share bytes: a tensor overlapping another is a corrupt header, not two views."""
    stored = sorted((t for t in tensors if t.nbytes), key=lambda t: t.offset)
    for before, after in zip(stored, stored[1:]):
        if after.offset < before.offset + before.nbytes:
            raise PitoolsError(f"{path}: corrupt safetensors header: tensors {before.name!r} and {after.name!r} overlap")


class NonFiniteTensor(PitoolsError):
    """A tensor holding NaN or infinite values (``pitools convert --allow-nonfinite`` writes them anyway)."""


class SafetensorsTensors:
    """The tensors of one or more safetensors files (a checkpoint's shards, a predictor folder's
    weights) by name, each memory-mapped when read. ``where`` names them in messages."""

    def __init__(self, paths: list[Path], where: str | Path):
        self.where = where
        self._tensors: dict[str, TensorInfo] = {}
        for path in paths:
            self._tensors.update(read_safetensors_header(path))

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise PitoolsError(f"{self.where}: no tensor {name!r}") from None

    def __getitem__(self, name: str) -> np.ndarray:
        return self.tensor(name)

    def check_finite(self, name: str, values: np.ndarray) -> None:
        """Refuse ``values`` (all or part of tensor ``name``) if any is NaN or infinite; the message
        counts them over the whole tensor, as float32 (what conversion writes)."""
        if values.dtype.kind == "f" and not np.isfinite(values).all():
            info = self.info(name)
            raise NonFiniteTensor(f"{info.path}: tensor {name!r} has {self._nonfinite_count(name)} "
                                  "non-finite values (NaN/inf)")

    def _nonfinite_count(self, name: str) -> int:
        flat = self.raw(name).reshape(-1)
        count = 0
        for start in range(0, flat.size, _CHUNK_ELEMENTS):
            chunk = flat[start : start + _CHUNK_ELEMENTS]
            chunk = bf16_to_float32(chunk) if self.info(name).dtype == "BF16" else chunk.astype(np.float32)
            count += int(np.count_nonzero(~np.isfinite(chunk)))
        return count

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
