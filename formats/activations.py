"""What an FFN computes per neuron, written once: the activation of its first product (a gated FFN's gate, OPT's
fc1) and a gated FFN's product of that with up.

Plain NumPy ufuncs and arithmetic, as ``activation_thresholds.clears``: NumPy applies them to arrays (CuPy's too:
NumPy's ufuncs hand a CuPy array to CuPy), and the compiled decoder compiles them for one value
(``kernels/numba_kernels.py``, inlined). A change here changes every engine (the reference, the general path,
prompts, the compiled decoder) and calibration alike.

The kinds are numbered (``NUMBERS``), since numba compiles a branch on an integer, not on an ``FFNKind``.
"""

from __future__ import annotations

import numpy as np

from powerinfer_tools.formats.model_spec import FFNKind

REGLU, DRELU, SWIGLU, GEGLU, RELU = range(5)
NUMBERS = {FFNKind.REGLU: REGLU, FFNKind.DRELU: DRELU, FFNKind.SWIGLU: SWIGLU, FFNKind.GEGLU: GEGLU,
           FFNKind.RELU: RELU}
GELU_SCALE = 0.7978845608028654  # sqrt(2 / pi)


def activation(kind, x):
    """act(x) for the kind numbered ``kind``: SiLU (SwiGLU), GELU's tanh approximation (GeGLU: transformers'
    ``gelu_pytorch_tanh``, ggml's ``gelu``), else relu (the ReLU family: a neuron fires where it is not 0)."""
    if kind == SWIGLU:
        return x / (1 + np.exp(-x))
    if kind == GEGLU:
        return 0.5 * x * (1 + np.tanh(GELU_SCALE * (x + 0.044715 * x * x * x)))
    return np.maximum(x, 0)


def gated(kind, gate, up):
    """A gated FFN's activated values from its gate's activation and its up products (dReLU's up relu'd too)."""
    return gate * (np.maximum(up, 0) if kind == DRELU else up)
