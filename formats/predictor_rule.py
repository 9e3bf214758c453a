"""The rule a predictor is applied with, written once: PowerInfer's per-layer MLP ``fc2 · relu(fc1 · x)``, a neuron
computed where its output reaches the threshold.

Plain NumPy ufuncs and comparisons, as ``activations.py``: NumPy applies them to arrays (CuPy's too: NumPy's ufuncs
hand a CuPy array to CuPy) in training (``predictors/fit.py``), profiling and the runtime's general path
(``runtime/ffn.py`` ``Predictor``), and the compiled decoder compiles them for one value (``runtime/ffn_decode.py``
``predict``). A change here changes every path; the file is a numba source (``kernels/numba_cache.py``).
"""

from __future__ import annotations

import numpy as np

SPARSE_THRESHOLD = 0.0  # GGUF key powerinfer.sparse_threshold; PowerInfer's default


def hidden_layer(products):
    """The predictor's hidden layer from its first products ``fc1 · x``: relu."""
    return np.maximum(products, 0)


def chooses(score, threshold):
    """Whether a neuron whose predictor output is ``score`` is computed: PowerInfer's sparse kernels skip rows
    with ``out < threshold``."""
    return score >= threshold


def scores(fc1, fc2, x):
    """The predictor's outputs ``fc2 · relu(fc1 · x)`` for the inputs ``x`` ``[T, d_model]``."""
    return hidden_layer(x @ fc1.T) @ fc2.T


def predict(fc1, fc2, x, threshold: float = SPARSE_THRESHOLD):
    """Which neurons are computed for the inputs ``x``, from predictor weights in floats."""
    return chooses(scores(fc1, fc2, x), threshold)
