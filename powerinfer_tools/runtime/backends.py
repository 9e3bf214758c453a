"""Where runtime work happens: the host CPU, a CUDA GPU through CuPy, or an emulated device.

A backend owns memory (weights uploaded once at load, KV caches) and tells the
engine which array module computes on it. Activation vectors move between
backends through ``receive``, which counts the bytes that cross the bus.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np

from .. import kernels
from ..errors import PitoolsError
from ..xp import cupy_or_none
from .quant import QuantMatrix


@dataclass
class TransferStats:
    bytes_to_device: int = 0
    bytes_to_host: int = 0


class CpuBackend:
    """The host. Weights stay memory-mapped in the model file: nothing is copied.

    Products go through the compiled kernels (``powerinfer_tools.kernels``), which
    fall back to the NumPy reference when they cannot load.
    """

    name = "cpu"
    xp: ModuleType = np
    is_device = False

    def matmul(self, m: QuantMatrix, x: np.ndarray, rows=None) -> np.ndarray:
        return kernels.matvec(m, x, rows)

    def row_sum(self, m: QuantMatrix, coeffs: np.ndarray, rows=None) -> np.ndarray:
        return kernels.row_axpy(m, coeffs, rows)

    def upload(self, array: np.ndarray) -> np.ndarray:
        return array

    def receive(self, array) -> np.ndarray:
        return array

    def send_home(self, array) -> np.ndarray:
        return array


class DeviceBackend:
    """Common part of the GPU backends: a memory pool with a budget and transfer counters."""

    is_device = True

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
            raise PitoolsError(
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


class CudaDevice(DeviceBackend):
    """A CUDA GPU through CuPy (``pip install 'powerinfer-tools[cuda]'``)."""

    name = "cuda"

    def __init__(self, budget_bytes: int):
        cupy = cupy_or_none()
        if cupy is None:
            raise PitoolsError("--device cuda: CuPy with a CUDA device is not available (pip install 'powerinfer-tools[cuda]')")
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
