"""Where runtime work happens: the host CPU, a CUDA GPU through CuPy, or an emulated device.

A backend owns memory (weights uploaded once at load, KV caches) and tells the
engine which array module computes on it. Activation vectors move between
backends through ``receive``, which counts the bytes that cross the bus.
"""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np

from powerinfer_tools import kernels
from powerinfer_tools.errors import PitoolsError, install_hint
from powerinfer_tools.kernels.interleaved import InterleavedQ4
from powerinfer_tools.kernels.quant import QuantMatrix
from powerinfer_tools.models.layers import attention, attention_each, score_scale
from powerinfer_tools.runtime.host_memory import keep_freed_memory
from powerinfer_tools.xp import cupy_or_none


@dataclass
class TransferStats:
    bytes_to_device: int = 0
    bytes_to_host: int = 0


class CpuBackend:
    """The host. Weights stay memory-mapped in the model file: nothing is copied, except the q4_0
    matrices that are always multiplied whole, which the loader interleaves for ggml's faster kernels
    (``kernels.interleaved``).

    Products go through the compiled kernels (``powerinfer_tools.kernels``), which
    fall back to the NumPy reference when they cannot load; blocks of more tokens
    than the kernels take (prompts) go through ggml's GEMM (q4_0 matrices used whole), bfloat16 products
    (``kernels.bf16_matmul`` / ``bf16_row_sum``, on a CPU with AVX-512 BF16), or ``_BlockProducts``.
    """

    name = "cpu"
    xp: ModuleType = np
    is_device = False

    def __init__(self):
        self._blocks = _BlockProducts()
        keep_freed_memory()  # a prompt's arrays reuse the memory the last layer freed (``host_memory``)

    def matmul(self, m: QuantMatrix | InterleavedQ4, x: np.ndarray, rows=None) -> np.ndarray:
        if isinstance(m, InterleavedQ4):  # ggml's gemv/gemm for that layout, which compute every row
            out = kernels.interleaved_matmul(m, x)
            return out if _every_row(rows, m.rows) else out[:, rows]
        if len(x) <= kernels.MAX_TOKENS or not kernels.available():
            return kernels.matvec(m, x, rows)
        if _every_row(rows, m.rows) and kernels.interleaves(m):
            # A block times every row of a q4_0 matrix kept in rows for one-token reads (a PowerInfer file's
            # gate and up, in a prompt that needs every neuron: dense mode, the thresholded rules): copied
            # interleaved for this product alone, ggml's GEMM with the copy takes 128 tokens faster than
            # dequantizing for BLAS does, at every shape measured (1536 x 576 to 11008 x 4096; docs/lab/kernels.md).
            return kernels.interleaved_matmul(kernels.for_whole_products(m), x)
        if kernels.bf16_matmuls(m):
            return kernels.bf16_matmul(m, x, rows)
        return self._blocks.matmul(m, x, rows)

    def row_sum(self, m: QuantMatrix, coeffs: np.ndarray, rows=None) -> np.ndarray:
        if len(coeffs) <= kernels.MAX_TOKENS or not kernels.available():
            return kernels.row_axpy(m, coeffs, rows)
        if kernels.bf16_row_sums(m):
            return kernels.bf16_row_sum(m, coeffs, rows)
        return self._blocks.row_sum(m, coeffs, rows)

    def attention(self, q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int, window: int | None,
                  scale: float | None, softcap: float | None = None) -> np.ndarray:
        """``layers.attention``, a prompt's compiled (``kernels.causal_attention``) where the kernels take it."""
        if kernels.attention_takes(len(q), q.shape[2]):
            return kernels.causal_attention(q, keys, values, start, window, score_scale(q.shape[2], scale), softcap)
        return attention(q, keys, values, start, window, scale, softcap)

    def attention_each(self, q: np.ndarray, stored: list[tuple[np.ndarray, np.ndarray]], window: int | None,
                       scale: float | None, softcap: float | None = None) -> np.ndarray:
        """``layers.attention_each``, in one compiled call (``kernels.one_query_each``) where the kernels are in
        use."""
        if kernels.available():
            return kernels.one_query_each(q, stored, window, score_scale(q.shape[2], scale), softcap)
        return attention_each(q, stored, window, scale, softcap)

    def upload(self, array: np.ndarray) -> np.ndarray:
        return array

    def receive(self, array) -> np.ndarray:
        return array

    def send_home(self, array) -> np.ndarray:
        return array


class _BlockProducts:
    """Products for many tokens at once: weight rows dequantized a chunk at a time and multiplied by OpenBLAS's
    ``sgemm``, single-threaded on each of the compiled kernels' threads (``kernels.block_matmul``; why their
    threads: ``kernels.numba_blocks``). OpenBLAS's own threads stall whenever one of them loses its core on a busy
    machine with few cores: a TinyLlama gate times 128 tokens took many times as long so, and longer than this way
    even with the block shared among Python threads. Without NumPy's OpenBLAS (another BLAS, another OS) the kernels
    take the block 32 tokens at a time."""

    def matmul(self, m: QuantMatrix, x: np.ndarray, rows=None) -> np.ndarray:
        if not _OPENBLAS.sgemm:
            return _by_token_chunks(lambda part: kernels.matvec(m, part, rows), x)
        with _OPENBLAS.single_threaded():
            return kernels.block_matmul(m, x, rows, _OPENBLAS.sgemm)

    def row_sum(self, m: QuantMatrix, coeffs: np.ndarray, rows=None) -> np.ndarray:
        if not _OPENBLAS.sgemm:
            return _by_token_chunks(lambda part: kernels.row_axpy(m, part, rows), coeffs)
        with _OPENBLAS.single_threaded():
            return kernels.block_row_sum(m, coeffs, rows, _OPENBLAS.sgemm)


def _every_row(rows, n_rows: int) -> bool:
    """Whether ``rows`` (None: all) selects every one of ``n_rows`` rows, in order."""
    return rows is None or (len(rows) == n_rows and np.array_equal(rows, np.arange(n_rows)))


def _by_token_chunks(product, x: np.ndarray) -> np.ndarray:
    """``product(x)`` for ``kernels.MAX_TOKENS`` tokens at a time."""
    n = kernels.MAX_TOKENS
    return np.concatenate([product(x[i : i + n]) for i in range(0, len(x), n)])


class _OpenBlas:
    """The OpenBLAS that NumPy loaded, through its C API: its thread count (as threadpoolctl does), and the
    address of its ILP64 ``cblas_sgemm`` for the compiled block products (0 where it has none)."""

    # numpy's wheels ship scipy-openblas, whose symbols carry a prefix and, for 64-bit ints, a suffix.
    _NAMES = tuple((f"{prefix}get_num_threads{suffix}", f"{prefix}set_num_threads{suffix}")
                   for prefix in ("scipy_openblas_", "openblas_") for suffix in ("64_", ""))
    _SGEMM_NAMES = ("scipy_cblas_sgemm64_", "cblas_sgemm64_")

    def __init__(self):
        self._get = self._set = None
        self.sgemm = 0
        try:
            maps = Path("/proc/self/maps").read_text()  # Linux: the libraries this process mapped
        except OSError:
            return
        for path in sorted({line.split()[-1] for line in maps.splitlines() if "openblas" in line.rsplit("/", 1)[-1]}):
            lib = ctypes.CDLL(path)
            for get, set_ in self._NAMES:
                if hasattr(lib, get) and hasattr(lib, set_):
                    self._get, self._set = getattr(lib, get), getattr(lib, set_)
                    self._get.restype = ctypes.c_int
                    sgemm = next((getattr(lib, n) for n in self._SGEMM_NAMES if hasattr(lib, n)), None)
                    self.sgemm = 0 if sgemm is None else ctypes.cast(sgemm, ctypes.c_void_p).value
                    return

    @property
    def available(self) -> bool:
        return self._set is not None

    @contextlib.contextmanager
    def single_threaded(self):
        previous = self._get()
        self._set(1)
        try:
            yield
        finally:
            self._set(previous)


_OPENBLAS = _OpenBlas()


def single_threaded_blas():
    """A context in which NumPy's BLAS runs on the calling thread alone (nothing where it is not
    OpenBLAS). The engine computes a prompt's attention in it: a layer's products are small, and
    OpenBLAS's threads, competing for the cores with the compiled kernels' idle workers, made the same
    products take hundreds of times as long on a machine with few cores (docs/lab/benchmarks-history.md)."""
    return _OPENBLAS.single_threaded() if _OPENBLAS.available else contextlib.nullcontext()


class OverBudget(PitoolsError):
    """An upload past the device's VRAM budget: the split asked for more than the budget it records."""


class DeviceBackend:
    """Common part of the GPU backends: a memory pool with a budget and transfer counters."""

    is_device = True
    attention = staticmethod(attention)
    attention_each = staticmethod(attention_each)

    def matmul(self, m: QuantMatrix, x, rows=None):
        return m.matmul(x, rows)

    def row_sum(self, m: QuantMatrix, coeffs, rows=None):
        return m.weighted_row_sum(coeffs, rows)

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.transfers = TransferStats()

    def _reserve(self, nbytes: int) -> None:
        if self.used_bytes + nbytes > self.budget_bytes:
            raise OverBudget(
                f"{self.name}: uploading {nbytes} bytes would exceed the VRAM budget of {self.budget_bytes} bytes "
                f"({self.used_bytes} already used); solve the split again for this budget"
            )
        self.used_bytes += nbytes


class EmulatedDevice(DeviceBackend):
    """An EMULATION of a GPU for machines without one, so tests exercise the split code path.

    It computes with NumPy on the host, but holds its weights in its own copies
    (its "VRAM"), refuses uploads beyond the budget, and counts every byte that
    would cross PCIe. Its results are those a real device would give up to float
    rounding; its speed means nothing.
    """

    name = "emulated-device"
    xp: ModuleType = np

    def upload(self, array: np.ndarray) -> np.ndarray:
        self._reserve(array.nbytes)
        return np.array(array, copy=True)

    def receive(self, array) -> np.ndarray:
        self.transfers.bytes_to_device += array.nbytes
        return array

    def send_home(self, array) -> np.ndarray:
        self.transfers.bytes_to_host += array.nbytes
        return array


def require_cupy() -> ModuleType:
    """CuPy, when it sees a CUDA device; else the error ``--device cuda`` reports."""
    cupy = cupy_or_none()
    if cupy is None:
        raise PitoolsError(f"--device cuda: CuPy with a CUDA device is not available ({install_hint('cuda')})")
    return cupy


class CudaDevice(DeviceBackend):
    """A CUDA GPU through CuPy (the ``cuda`` extra)."""

    name = "cuda"

    def __init__(self, budget_bytes: int):
        cupy = require_cupy()
        super().__init__(budget_bytes)
        self.xp = cupy

    def upload(self, array: np.ndarray):
        self._reserve(array.nbytes)
        return self.xp.asarray(np.ascontiguousarray(array))

    def receive(self, array):
        self.transfers.bytes_to_device += array.nbytes
        return self.xp.asarray(array)

    def send_home(self, array) -> np.ndarray:
        self.transfers.bytes_to_host += array.nbytes
        return self.xp.asnumpy(array)


def move(array, source, target):
    """Carry an activation array from one backend to another (through the host)."""
    if source is target:
        return array
    return target.receive(source.send_home(array))
