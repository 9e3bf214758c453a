"""ggml's type traits from ``libggml-base``, the library beside ``libggml-cpu`` in llama-cpp-python's package.

Its public header (``ggml.h``) exports ``ggml_get_type_traits(type)``, which returns

    struct ggml_type_traits {
        const char      *type_name;
        int64_t          blck_size;
        int64_t          blck_size_interleave;
        size_t           type_size;
        bool             is_quantized;
        ggml_to_float_t  to_float;        // void (const void *x, float *y, int64_t k): k values of a row as float
        ggml_from_float_t from_float_ref;
    };

and ``ggml_quantize_chunk``, the quantizer llama.cpp's ``llama-quantize`` runs. The runtime takes from it
``to_float`` for the weight types it has no decoder of its own for (``formats/weight_types.py``): the
float rows that a product needs (a prompt's BLAS products, the down projection's axpy) come from
ggml's C loop, one call for a whole run of rows, instead of gguf's NumPy one (tens of times slower).

Pinned like ``ggml_ops`` (ggml 0.25.3, llama-cpp-python 0.3.36), and checked before use: each type's
block size and bytes against gguf's ``GGML_QUANT_SIZES``, and ``to_float`` bit for bit against gguf's
reference dequantizer on rows of random bytes (``check_rows``). Nothing here is used from a library that fails
a check.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from powerinfer_tools.formats.quantization import storage_shape
from powerinfer_tools.formats.weight_types import WEIGHT_TYPES

_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class GgmlUnavailable(RuntimeError):
    """The ggml routines cannot be used; the message says why."""


class _TypeTraits(ctypes.Structure):
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


@dataclass(frozen=True)
class GgmlBase:
    """The checked ``libggml-base``: ``to_float`` by weight type (all but f32), its quantizer."""

    library: ctypes.CDLL
    lib_dir: Path
    version: str  # llama-cpp-python's
    to_float: dict[GGMLQuantizationType, int]

    def dequantize(self, raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
        """float32 ``[rows, cols]`` from stored rows ``[rows, row_bytes]``: one ``to_float`` call for them all."""
        raw = np.ascontiguousarray(raw).view(np.uint8)  # f16 rows arrive as float16
        t = WEIGHT_TYPES[qtype]
        out = np.empty((raw.shape[0], raw.shape[1] // t.block_bytes * t.block_size), dtype=np.float32)
        _TO_FLOAT(self.to_float[qtype])(raw.ctypes.data, out.ctypes.data, out.size)  # releases the GIL
        return out

    def quantize(self, rows: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
        """Float32 ``rows`` in ``qtype``'s storage layout, as llama-quantize (without an importance matrix)
        writes them: the only quantizer of the k-quants at hand (gguf-py has none)."""
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        shape, dtype = storage_shape(rows.shape, qtype)
        out = np.empty(shape, dtype)
        written = self.library.ggml_quantize_chunk(int(qtype), rows.ctypes.data, out.ctypes.data, 0, rows.shape[0],
                                                   rows.shape[1], None)
        assert written == out.nbytes, (qtype.name, written, out.nbytes)
        return out


def package_lib_dir() -> tuple[Path, str]:
    """llama-cpp-python's ``lib/`` folder and version, or GgmlUnavailable."""
    # find_spec locates the package without importing it (importing would load libllama too).
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise GgmlUnavailable("llama-cpp-python is not installed (pip install llama-cpp-python)")
    lib_dir = Path(next(iter(spec.submodule_search_locations))) / "lib"
    if not (lib_dir / "libggml-cpu.so").exists():
        # e.g. a build with GGML_BACKEND_DL, which ships per-CPU variants instead of one library
        raise GgmlUnavailable(f"{lib_dir} has no libggml-cpu.so")
    try:
        version = importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return lib_dir, version


def load() -> GgmlBase:
    """The checked library, loaded once, or GgmlUnavailable."""
    base = _load_or_reason()
    if isinstance(base, str):
        raise GgmlUnavailable(base)
    return base


def loaded() -> GgmlBase | None:
    """The checked library, or None where it cannot load (the NumPy decoders serve)."""
    base = _load_or_reason()
    return None if isinstance(base, str) else base


@functools.cache
def _load_or_reason() -> GgmlBase | str:
    try:
        return _checked(*_open())
    except GgmlUnavailable as exc:
        return str(exc)


def _open() -> tuple[ctypes.CDLL, Path, str]:
    lib_dir, version = package_lib_dir()
    path = lib_dir / "libggml-base.so"
    try:
        base = ctypes.CDLL(str(path))
        base.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
        base.ggml_get_type_traits.argtypes = [ctypes.c_int]
        base.ggml_quantize_chunk.restype = ctypes.c_size_t
        base.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                             ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    except (OSError, AttributeError) as exc:  # missing file, or a build without these symbols
        raise GgmlUnavailable(f"cannot load {path}: {exc}") from exc
    return base, lib_dir, version


def _checked(library: ctypes.CDLL, lib_dir: Path, version: str) -> GgmlBase:
    """The library once every weight type's traits agree with gguf's sizes and its reference dequantizer."""
    origin = f"{lib_dir / 'libggml-base.so'} (llama-cpp-python {version})"
    to_float = {}
    for qtype, t in WEIGHT_TYPES.items():
        traits = library.ggml_get_type_traits(int(qtype)).contents
        if (traits.blck_size, traits.type_size) != (t.block_size, t.block_bytes):
            raise GgmlUnavailable(f"{origin}: ggml type id {int(qtype)} is not {qtype.name} "
                                  f"(block of {traits.blck_size} values in {traits.type_size} bytes)")
        if traits.to_float:  # every type but f32
            to_float[qtype] = traits.to_float
    base = GgmlBase(library, lib_dir, version, to_float)
    for qtype in to_float:
        stored = check_rows(qtype)
        with np.errstate(all="ignore"):  # random scales: f16's infinities and NaNs among them, alike on both sides
            reference = WEIGHT_TYPES[qtype].dequantize(stored)
        if not np.array_equal(base.dequantize(stored, qtype), reference, equal_nan=True):
            raise GgmlUnavailable(f"{origin}: {qtype.name} to_float differs from gguf's dequantizer")
    return base


def check_rows(qtype: GGMLQuantizationType) -> np.ndarray:
    """The stored rows the library is checked on (``to_float`` here, ``vec_dot`` in ``ggml_ops``): eight rows of
    512 values. A quantized type's are random bytes: any bytes are a stored row to a dequantizer, and random ones
    reach every field's range (a quantizer's output would not, and ggml's for iq3_s first builds its grid tables:
    a cost at every start). A float type's are random normal values (random bits would make one f16 in 32 an
    infinity or a NaN, and nearly every row hold one)."""
    rng = np.random.default_rng(0)
    if WEIGHT_TYPES[qtype].block_size == 1:  # f32, f16, bf16
        return quantize(rng.standard_normal((8, 512)).astype(np.float32), qtype)
    shape, dtype = storage_shape((8, 512), qtype)
    return rng.integers(0, 256, shape, dtype=dtype)
