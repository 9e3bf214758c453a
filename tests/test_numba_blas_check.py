"""``kernels.numba_blas_check``: numba's registries load without importing all of scipy.linalg, and leave no trace."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import numpy as np
from numba import njit
from powerinfer_tools import kernels

if kernels.available():  # a run's first compiled call, which loads numba's registries
    from powerinfer_tools.kernels import numba_kernels
    numba_kernels.one_token_partials(2, 32, 1)
else:
    from powerinfer_tools.kernels import numba_blas_check
    numba_blas_check.registries_loaded()
print("scipy.linalg imported:", "scipy.linalg" in sys.modules)
print("cython_blas left behind:", "scipy.linalg.cython_blas" in sys.modules)

@njit
def product(a, b):
    return np.dot(a, b)  # needs the BLAS that numba checked for

a = np.arange(9.0).reshape(3, 3)
print("numba's dot right:", bool(np.allclose(product(a, a), a @ a)))
import scipy.linalg.cython_blas
import scipy.linalg
print("scipy's own after:", scipy.linalg.cython_blas.__name__ == "scipy.linalg.cython_blas",
      bool(np.allclose(scipy.linalg.solve(np.eye(3) * 2, np.ones(3)), 0.5)))
"""


def test_numba_loads_without_scipy_linalg_and_scipy_imports_its_own_after():
    out = subprocess.run([sys.executable, "-c", CHECK], check=True, capture_output=True, text=True).stdout
    assert out.splitlines() == ["scipy.linalg imported: False", "cython_blas left behind: False",
                                "numba's dot right: True", "scipy's own after: True True"], out
