"""NumPy or CuPy: code written against ``xp`` runs on the array module its inputs live in."""

from __future__ import annotations

import sys
from types import ModuleType

import numpy as np


def array_namespace(a) -> ModuleType:
    """CuPy for a CuPy array, NumPy for anything else (CuPy is never imported here); named as in the
    array API standard."""
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(a, cupy.ndarray):
        return cupy
    return np


def cupy_or_none() -> ModuleType | None:
    """CuPy when it is installed and sees a CUDA device; None otherwise."""
    try:
        import cupy
    except ImportError:
        return None
    try:
        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:  # no driver, no device: CuPy raises its own CUDA errors
        return None
