"""The class-weighted binary cross-entropy's gradient with respect to the logits, fused (NumPy arrays).

On the TinyLlama shape a training step's logits are a [512, 5632] matrix. At small hidden sizes
the step's matrix products are cheap and NumPy's elementwise sigmoid and ``where`` (six passes
over that matrix, each allocating it) took ~80% of the step; this loop makes one pass, in place,
on both cores (~3x less CPU time than NumPy's passes, measured single-threaded). Imported only
when a NumPy trainer runs, so that the CLI does not load numba to start.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(parallel=True, nogil=True, cache=True)
def logit_gradient_inplace(logits, fired, pos_scale, neg_scale):
    """Overwrite ``logits`` with ``pos_scale·(p - 1)`` where ``fired``, else ``neg_scale·p``, for
    ``p = sigmoid(logits)``."""
    for i in prange(logits.shape[0]):
        row, y = logits[i], fired[i]
        for j in range(row.shape[0]):
            p = 1 / (1 + np.exp(-row[j]))
            row[j] = pos_scale * (p - 1) if y[j] else neg_scale * p
