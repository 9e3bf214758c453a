"""Model files: GGUF v3, optionally marked as PowerInfer files, written as a stream and read in place.

Writing: the header, the metadata and every tensor's name, shape and type go
out first (gguf-py's ``add_tensor_info`` / ``write_*_to_file``); then each
tensor's data is produced in row chunks, encoded, and written with
``write_tensor_data`` before the next tensor is touched. At most one output
tensor is in memory at a time.

A PowerInfer file is byte for byte a GGUF file whose first four bytes read
``PWRI`` instead of ``GGUF``: this is how PowerInfer's ``convert.py`` marks
files for sparse inference, and its loader accepts both magics. Our reader does
the same, on top of gguf-py's ``GGUFReader``; tensors are memory-mapped and
returned without copying.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Sequence

import numpy as np
from gguf import GGUF_MAGIC, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, Keys
from powerinfer_tools.formats.constants import POWERINFER_MAGIC_BYTES
from powerinfer_tools.formats.fingerprint import header_fingerprint
from powerinfer_tools.formats.metadata_keys import MODEL_KEYS, check_metadata
from powerinfer_tools.formats.quantization import decode, encode, storage_shape

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.progress import progress_bar

GGUF_MAGIC_BYTES = b"GGUF"
POWERINFER_MAGIC = int.from_bytes(POWERINFER_MAGIC_BYTES, "little")
_F16_MAX = float(np.finfo(np.float16).max)
_CHUNK_BYTES = 16 << 20  # float32 rows encoded at a time


# --- writing ------------------------------------------------------------------------------------


def stored_nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    """Bytes a tensor of element ``shape`` takes stored as ``qtype``."""
    shape, dtype = storage_shape(shape, qtype)
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


@dataclass(frozen=True)
class OutputTensor:
    """A tensor to write: its GGUF name, NumPy-order element shape, type, and where its rows come from.

    ``rows(start, stop)`` returns float32 rows ``start .. stop-1`` (elements, for 1-D
    tensors) exactly as they are to be stored, already transposed or reordered.
    """

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    rows: Callable[[int, int], np.ndarray]

    @property
    def nbytes(self) -> int:
        return stored_nbytes(self.shape, self.qtype)

    def encoded(self) -> np.ndarray:
        """The whole tensor in its storage layout, built a chunk of rows at a time."""
        shape, dtype = storage_shape(self.shape, self.qtype)
        out = np.empty(shape, dtype=dtype)
        row_bytes = 4 * int(np.prod(self.shape[1:], dtype=np.int64))
        step = max(1, _CHUNK_BYTES // row_bytes)
        for start in range(0, self.shape[0], step):
            stop = min(start + step, self.shape[0])
            rows = self.rows(start, stop)
            if self.qtype == GGMLQuantizationType.F16 and _beyond_f16(rows):
                raise PitoolsError(f"tensor {self.name} holds values beyond float16's range (+-{_F16_MAX:g}); "
                                   "write it with --outtype f32")
            out[start:stop] = encode(rows, self.qtype)
        return out


@dataclass(frozen=True)
class CopiedTensor:
    """A tensor to write whose stored bytes already exist: ``stored()`` returns them (``[shape]`` for
    f32/f16/i8, ``uint8 [rows, row_bytes]`` for block types), built when the writer reaches it."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    stored: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return stored_nbytes(self.shape, self.qtype)

    def encoded(self) -> np.ndarray:
        return self.stored()


def copy_metadata(source: ModelFile, writer: GGUFWriter, skip: Collection[str] = ()) -> None:
    """Every metadata key of ``source`` but the architecture (the writer's own) and ``skip``, with its type."""
    reader = _Reader(source.path)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in skip or name == Keys.General.ARCHITECTURE:
            continue
        sub_type = GGUFValueType(field.types[1]) if len(field.types) > 1 else None
        writer.add_key_value(name, field.contents(), GGUFValueType(field.types[0]), sub_type)


def _beyond_f16(rows: np.ndarray) -> bool:
    """Whether a finite value would become infinite in float16 (inf stays inf: --allow-nonfinite)."""
    big = np.abs(rows) > _F16_MAX
    return bool(big.any() and np.isfinite(rows[big]).any())


class ModelFileWriter:
    """Writes one model file. Add metadata through ``gguf`` (a ``GGUFWriter``), then call ``write``."""

    def __init__(self, path: str | os.PathLike, architecture: str, powerinfer: bool):
        self.path = Path(path)
        self.powerinfer = powerinfer
        self.gguf = GGUFWriter(self.path, architecture)

    def write(self, tensors: Sequence[OutputTensor], progress: bool = True) -> None:
        for t in tensors:
            self.gguf.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
        try:
            self.gguf.write_header_to_file()
            self.gguf.write_kv_data_to_file()
            self.gguf.write_ti_data_to_file()
            bar = progress_bar(total=sum(t.nbytes for t in tensors), desc="write", unit="B", unit_scale=True,
                               enabled=progress, leave=False)
            with bar:
                for i, t in enumerate(tensors, 1):
                    bar.set_description(f"tensor {i}/{len(tensors)} {t.name}")
                    self.gguf.write_tensor_data(t.encoded())
                    bar.update(t.nbytes)
        finally:
            self.gguf.close()
        if self.powerinfer:
            with open(self.path, "r+b") as f:
                f.write(POWERINFER_MAGIC_BYTES)


# --- reading ------------------------------------------------------------------------------------


class _Reader(GGUFReader):
    """gguf-py's reader, also accepting PowerInfer's magic (the rest of the layout is GGUF's), and
    refusing any read past the end of the file: gguf-py would return a short array there, and a
    corrupt count then loops for ever or fails somewhere far from the cause."""

    def _get(self, offset, dtype, count=1, override_order=None):
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise ValueError(f"truncated: {int(count)} x {np.dtype(dtype)} at byte {int(offset)} "
                             f"ends past the file's {len(self.data)} bytes")
        values = super()._get(offset, dtype, count, override_order)
        if offset == 0 and count == 1 and values[0] == POWERINFER_MAGIC:
            return np.array([GGUF_MAGIC], dtype=values.dtype)
        return values

    def _build_tensor_info(self, offs, count):
        end, fields = super()._build_tensor_info(offs, count)
        self.tensor_table_end = end  # where the alignment padding before the tensor data starts
        return end, fields

    def _get_field_parts(self, orig_offs, raw_type):
        """gguf-py's, but an array of numbers read as one part and an array of strings walked without gguf-py's
        two checked NumPy reads per item, whose cost per token adds up to seconds for a 262,144-token vocabulary,
        all before the first token."""
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_item, length = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        item, count = int(raw_item[0]), int(length[0])
        number = self.gguf_scalar_to_np.get(item)
        if number is not None:
            values = self._get(orig_offs + 12, number, count)
            return 12 + values.nbytes, [raw_item, length, values], [2], [GGUFValueType.ARRAY, GGUFValueType(item)]
        if item == GGUFValueType.STRING and self.byte_order == "I":
            return self._string_array(orig_offs, [raw_item, length], count)
        return super()._get_field_parts(orig_offs, raw_type)

    def _string_array(self, orig_offs: int, parts: list, count: int):
        """The parts gguf-py makes of an array of ``count`` strings (each one's length and bytes), for a file
        in this machine's byte order."""
        data, offs, indexes = self.data.view(np.ndarray), orig_offs + 12, []
        for _ in range(count):
            if offs + 8 > len(data):
                raise ValueError(f"truncated: a string's length at byte {offs} ends past the file's {len(data)} bytes")
            size = int.from_bytes(data[offs:offs + 8], sys.byteorder)  # "I": the file is in this order
            if offs + 8 + size > len(data):
                raise ValueError(f"truncated: a string of {size} bytes at byte {offs} ends past the file's "
                                 f"{len(data)} bytes")
            parts += (data[offs:offs + 8].view(np.uint64), data[offs + 8:offs + 8 + size])
            indexes.append(len(parts) - 1)
            offs += 8 + size
        return offs - orig_offs, parts, indexes, [GGUFValueType.ARRAY, GGUFValueType.STRING]


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a model file.

    ``shape`` is the element shape in NumPy order (rows first: GGML's ``ne``
    reversed). ``data`` is a read-only view into the memory-mapped file: float32 or
    float16 ``[shape]`` for f32/f16, ``uint8 [rows, row_bytes]`` for q8_0/q4_0 --
    the layout ``gguf.quants`` and the runtime's ``QuantMatrix`` use.
    """

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray
    offset: int  # where ``data`` starts in the file, for reads that bypass the mapping (direct I/O)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def dequantize(self) -> np.ndarray:
        """A float32 copy (a view for f32)."""
        return decode(self.data, self.qtype).reshape(self.shape)


@dataclass(frozen=True)
class ModelFile:
    """A GGUF or PowerInfer model file, opened read-only."""

    path: Path
    powerinfer: bool  # PWRI magic: PowerInfer's sparse layout
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, StoredTensor]
    # the mapped bytes before the tensor data: header, metadata, tensor table (uint8)
    header: np.ndarray = dataclasses.field(compare=False, repr=False)

    @property
    def architecture(self) -> str:
        return self.metadata[Keys.General.ARCHITECTURE]

    def fingerprint(self) -> str:
        """``fingerprint.model_fingerprint`` of this file, from the header already read."""
        return header_fingerprint(self.header)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> StoredTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise PitoolsError(f"{self.path}: model file has no tensor {name!r}") from None

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value; ``{arch}`` in ``key`` stands for the architecture. A key of
        ``metadata_keys.MODEL_KEYS`` holds what its entry says: the file was refused otherwise."""
        return self.metadata.get(key.format(arch=self.architecture), default)


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    # GGUFReader also lists the header words as "GGUF.*" fields; they are not metadata.
    return {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}


def _tensors(reader: GGUFReader) -> dict[str, StoredTensor]:
    # _Reader has checked that every tensor's data ends within the file; it must also start after the header.
    for t in reader.tensors:
        if t.data_offset < reader.data_offset:
            raise ValueError(f"tensor {t.name!r} starts at byte {t.data_offset}, inside the header")
    return {
        t.name: StoredTensor(
            t.name, GGMLQuantizationType(t.tensor_type), tuple(int(n) for n in reversed(t.shape.tolist())), t.data,
            int(t.data_offset),
        )
        for t in reader.tensors
    }


# What gguf-py raises on a corrupt file: bad enum values and sizes (ValueError), duplicate keys
# (KeyError), undecodable names (UnicodeDecodeError), numbers out of range (OverflowError), deep
# array nesting (RecursionError), arrays too long to hold (MemoryError), and the odd IndexError
# and TypeError on malformed parts.
_CORRUPT = (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError, RecursionError, MemoryError)


def _check_regular_file(path: Path) -> None:
    if not path.exists():
        raise PitoolsError(f"{path}: no such file")
    if path.is_dir():
        raise PitoolsError(f"{path}: is a directory, not a model file")
    if not path.is_file():
        raise PitoolsError(f"{path}: not a regular file (a device, pipe or socket), not a model file")


def open_model_file(path: str | os.PathLike) -> ModelFile:
    """Open a GGUF or PowerInfer file; tensors are memory-mapped, nothing is read eagerly."""
    path = Path(path)
    _check_regular_file(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic not in (GGUF_MAGIC_BYTES, POWERINFER_MAGIC_BYTES):
            raise PitoolsError(f"{path}: not a GGUF or PowerInfer model file (magic {magic!r})")
        with np.errstate(all="ignore"):  # a corrupt offset overflows in gguf-py's sums: our bounds check reports it
            reader = _Reader(path)
            metadata, tensors = _metadata(reader), _tensors(reader)
    except OSError as exc:
        raise PitoolsError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except _CORRUPT as exc:
        raise PitoolsError(f"{path}: corrupt or truncated model file ({' '.join(str(exc).split())})") from None
    if not isinstance(metadata.get(Keys.General.ARCHITECTURE), str):
        raise PitoolsError(f"{path}: model file has no {Keys.General.ARCHITECTURE} string")
    check_metadata(path, metadata, MODEL_KEYS)  # so every reader of a key gets a value of its type
    version = int(reader.fields["GGUF.version"].parts[0][0])
    header = reader.data[:reader.tensor_table_end].view(np.ndarray)
    return ModelFile(path, magic == POWERINFER_MAGIC_BYTES, version, metadata, tensors, header)
