"""A model file's identity, read without its weights: a hash of everything before the tensor data.

A GGUF file starts with its header, its metadata (hyperparameters, tokenizer and, in our PowerInfer
files, the profiled firing frequencies) and its tensor table (names, types, shapes, offsets); the
tensor data follows. Hashing that first part tells models apart as well as their conversion does --
another checkpoint has another profile, another quantization other tensor types -- and reads a few
megabytes of a multi-gigabyte file. What it cannot tell apart is two files equal up to their weights
(a fine-tune converted without profiling, by a tool that records nothing of it). See the split file's
``pitools.model_fingerprint`` in formats/README.md.
"""

from __future__ import annotations

import hashlib
import mmap
from pathlib import Path

from gguf import GGUFValueType

from powerinfer_tools.errors import PitoolsError

_SCALAR_BYTES = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}


class _Cursor:
    """Reads little-endian GGUF fields from ``data`` at a moving position."""

    def __init__(self, data: mmap.mmap):
        self.data, self.position = data, 0

    def integer(self, size: int) -> int:
        value = int.from_bytes(self.data[self.position : self.position + size], "little")
        self.skip(size)
        return value

    def skip(self, size: int) -> None:
        self.position += size
        if self.position > len(self.data):
            raise ValueError("the header runs past the end of the file")

    def skip_string(self) -> None:
        self.skip(self.integer(8))

    def skip_value(self, kind: int) -> None:
        kind = GGUFValueType(kind)
        if kind in _SCALAR_BYTES:
            self.skip(_SCALAR_BYTES[kind])
        elif kind is GGUFValueType.STRING:
            self.skip_string()
        else:  # an array: item type, count, items
            item, count = GGUFValueType(self.integer(4)), self.integer(8)
            if item in _SCALAR_BYTES:
                self.skip(count * _SCALAR_BYTES[item])
            else:
                for _ in range(count):  # ends at the file's end at the latest: each item takes >= 8 bytes
                    self.skip_value(item)


def _tensor_data_start(data: mmap.mmap) -> int:
    """Where the tensor table ends (GGUF v2 and v3: 64-bit counts and lengths)."""
    cursor = _Cursor(data)
    cursor.skip(4)  # magic: GGUF, or PowerInfer's PWRI
    version = cursor.integer(4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}, expected 2 or 3")
    n_tensors, n_keys = cursor.integer(8), cursor.integer(8)
    for _ in range(n_keys):
        cursor.skip_string()
        cursor.skip_value(cursor.integer(4))
    for _ in range(n_tensors):
        cursor.skip_string()  # name
        cursor.skip(8 * cursor.integer(4) + 4 + 8)  # dimensions, type, offset
    return cursor.position


def header_fingerprint(header) -> str:
    """``blake2b:<32 hex digits>``: the hash of a file's bytes before its tensor data (a buffer)."""
    return "blake2b:" + hashlib.blake2b(header, digest_size=16).hexdigest()


def model_fingerprint(path: str | Path) -> str:
    """The fingerprint of ``path``'s header, metadata and tensor table, read without the rest of what
    ``open_model_file`` reads (an open file has it: ``ModelFile.fingerprint``)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return header_fingerprint(data[:_tensor_data_start(data)])
    except OSError as exc:
        raise PitoolsError(f"{path}: cannot read model file: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise PitoolsError(f"{path}: corrupt or truncated model file ({exc})") from None
