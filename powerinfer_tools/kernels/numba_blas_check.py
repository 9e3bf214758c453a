"""numba's start without all of scipy.linalg.

The first compiled call of a process loads numba's registries, and one of them (``numba.np.arraymath``) checks
at import that a BLAS is there by importing ``scipy.linalg.cython_blas``: Python imports the whole
``scipy.linalg`` package first, 0.19-0.22 s of a 0.8 s warm ``pitools run`` here (``python -X importtime``). Our
kernels never ask numba for a BLAS product (the prompt's products call NumPy's OpenBLAS themselves,
``kernels.numba_blocks``), and the extension module alone loads in ~3 ms. So ``registries_loaded`` puts it where
the import finds it, has numba load its registries, and takes it away again: a later ``import scipy.linalg``
imports its own, as if this had not happened.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_NAME = "scipy.linalg.cython_blas"


def registries_loaded() -> None:
    """Load numba's registries (what its first compiled call would), with ``scipy.linalg.cython_blas`` loaded
    alone for its BLAS check where ``scipy.linalg`` is not imported yet."""
    from numba.core.registry import cpu_target

    alone = None if "scipy.linalg" in sys.modules or _NAME in sys.modules else _load_alone()
    if alone is not None:
        sys.modules[_NAME] = alone
    try:
        cpu_target.target_context.refresh()
    finally:
        if alone is not None and sys.modules.get(_NAME) is alone:
            del sys.modules[_NAME]


def _load_alone():
    """The extension module of ``scipy.linalg.cython_blas`` without its package's ``__init__``, or None (no
    SciPy, another layout: numba then imports it as it would)."""
    try:
        import scipy

        folder = Path(scipy.__file__).parent / "linalg"
        path = next(folder.glob("cython_blas.*.so"), None) or next(folder.glob("cython_blas.*.pyd"), None)
        if path is None:
            return None
        spec = importlib.util.spec_from_file_location(_NAME, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except Exception:  # noqa: BLE001 - any failure here only means numba imports it itself
        return None
