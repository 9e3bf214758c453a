"""The compiled decoder's thresholded FFN for one token (``w``: its ``LayerWeights``, ``s``: its ``Scratch``):
the loops of the rules ``thresholded_ffn.ffn`` computes on the general path (CATS, TEAL, and the gate's exact
choice of a ReLU family's neurons: CATS at threshold 0 on relu), called by ``ffn_decode.choose`` and ``ffn`` where
the layer's plan has them. Apart from ``thresholded_ffn`` because this module imports numba, which a model on the
NumPy reference kernels never loads.
"""

from __future__ import annotations

from numba import njit

from powerinfer_tools.formats.activation_thresholds import clears
from powerinfer_tools.formats.activations import DRELU, REGLU
from powerinfer_tools.kernels import numba_kernels as nk
from powerinfer_tools.kernels.numba_cache import prepare_cache


_clears = njit(inline="always")(clears)  # the rules' test, as the general path applies it to arrays


@njit(inline="always")
def _cats_keeps(g, t, bounds, kind):
    """Whether act(g) clears t (``clears``): a ReLU family's relu(g) itself; SiLU's and GELU's by comparing g with
    ``bounds`` (``thresholded_ffn.cats_bounds``), without exp or tanh, except within the margin of a bound, where
    the comparison gives way to the rule itself. The comparisons are combined without branches (``&``, ``|``):
    which neurons a token keeps is close to a coin toss, which a branch would mispredict; the margin's branch is
    almost never taken, and the kind's is the same for every neuron."""
    if kind == REGLU or kind == DRELU:
        return _clears(nk.activation(kind, g), t)
    above, band_lo, band_hi, margin = bounds[0], bounds[1], bounds[2], bounds[3]
    if (abs(g - above) < margin) | (abs(g - band_lo) < margin) | (abs(g - band_hi) < margin):
        return _clears(nk.activation(kind, g), t)
    return (g > above) | ((band_lo < g) & (g < band_hi))


@njit(nogil=True, cache=True)
def teal_input(h, threshold):
    """TEAL on the FFN's input: the entries of ``h`` that do not clear ``threshold`` set to 0, in place."""
    for i in range(h.shape[0]):
        if not _clears(h[i], threshold):
            h[i] = 0.0


@njit(nogil=True, cache=True)
def cats_choice(w, s):
    """CATS's neurons (a ReLU family's: those that fire) from every neuron's gate product (``s.predicted``, by
    row): those whose |gate activation| exceeds the threshold, into ``s.active``; returns their count."""
    n = 0
    for neuron in range(s.act.shape[0]):  # written every time, kept by moving on: no branch on the choice
        s.active[n] = neuron
        n += _cats_keeps(s.predicted[neuron], w.cats, w.cats_bounds, w.kind)
    return n


@njit(nogil=True, cache=True)
def drop_small_down_inputs(s, rows, threshold):
    """TEAL on the down projection's input: the rows of ``rows`` whose activation in ``s.act`` exceeds
    ``threshold`` into ``s.down_rows``, their activations moved to the front of ``s.act``; returns their count."""
    m = 0
    for i in range(rows.shape[0]):  # without a branch on the choice, as in ``cats_choice``
        s.down_rows[m] = rows[i]
        s.act[m] = s.act[i]  # position m's own value was read at i = m <= this i
        m += _clears(s.act[m], threshold)
    return m


prepare_cache(globals())  # stale machine code flushed, the rest loaded without the compiler (kernels.numba_cache)
