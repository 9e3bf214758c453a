"""Soft-capping (Gemma 2's attention scores and final logits), written once: ``cap * tanh(x / cap)``, which keeps
a value within (-cap, cap) and leaves small ones almost as they are.

Plain NumPy arithmetic, as ``formats/activations.py``: NumPy applies it to arrays (CuPy's too), and the compiled
attention kernels compile it for one score (``kernels/numba_attention.py``, inlined), so every engine caps alike.
A model without a cap has ``ModelSpec``'s None, which the compiled kernels take as 0: no cap, and no cost.
"""

from __future__ import annotations

import numpy as np


def soft_capped(x, cap):
    """``x`` soft-capped at ``cap`` (> 0)."""
    return cap * np.tanh(x / cap)
