"""The compiled decoder's thresholded FFN for one token (``w``: its ``LayerWeights``, ``s``: its ``Scratch``):
the loops of the rules ``thresholded_ffn`` computes on the general path (CATS, TEAL, and the gate's exact
choice of a ReLU family's neurons: CATS at threshold 0 on relu), called by ``compiled_decode.decode_layer``.
Apart from ``thresholded_ffn`` because this module imports numba, which a model on the NumPy reference kernels
never loads.
"""

from __future__ import annotations

from numba import njit

from powerinfer_tools.formats.activation_thresholds import clears
from powerinfer_tools.formats.activations import DRELU, REGLU
from powerinfer_tools.kernels import numba_interleaved
from powerinfer_tools.kernels import numba_kernels as nk
from powerinfer_tools.kernels.numba_kernels import ggml_from_float
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
def thresholded_input(w, s, kind, fns, n_threads):
    """A thresholded layer's FFN input, encoded in ``s.x_encoded``, and its neurons to compute in
    ``s.active``; returns their count. TEAL (``ffn_in``) first drops the input's small entries; CATS
    computes the gate product of every neuron (into ``s.predicted``, by row) and keeps those whose |gate
    activation| (a ReLU family's relu: those that fire) exceeds the threshold; without CATS every neuron is computed."""
    d_model, d_ff = s.h.shape[0], s.act.shape[0]  # (up may be interleaved: not its rows)
    if w.ffn_in >= 0:
        for i in range(d_model):
            if not _clears(s.h[i], w.ffn_in):
                s.h[i] = 0.0
    ggml_from_float(fns[w.ffn_type, 0], s.h.ctypes.data, s.x_encoded.ctypes.data, d_model)
    if w.cats < 0:
        s.active[:d_ff] = s.all_rows[:d_ff]
        return d_ff
    whole_gate(w, s, d_model, fns, n_threads)
    n = 0
    for neuron in range(d_ff):  # written every time, kept by moving on: no branch on the choice
        s.active[n] = neuron
        n += _cats_keeps(s.predicted[neuron], w.cats, w.cats_bounds, kind)
    return n


@njit(nogil=True, cache=True)
def whole_gate(w, s, d_model, fns, n_threads):
    """Every neuron's gate product into ``s.predicted`` from the encoded input; where up is interleaved too
    (``up_gemv``: a layer that computes most neurons, or a dense file's), every up product into ``s.up_out``
    in the same parallel loop."""
    if w.up_gemv:
        numba_interleaved.gemv_fused(w.up_gemv, w.gate, w.up, numba_interleaved.NO_GROUPS, s.x_encoded, d_model,
                                     s.predicted, s.up_out, s.o[:0], n_threads, w.vnni)
    elif w.gate_gemv:
        numba_interleaved.gemv(w.gate_gemv, w.gate, s.x_encoded, d_model, s.predicted, n_threads, w.vnni)
    else:
        nk.matvec(fns[w.ffn_type, 1], w.gate, s.x_encoded, d_model, s.predicted)


@njit(nogil=True, cache=True)
def drop_small_down_inputs(s, rows, threshold):
    """TEAL on the down projection's input: the rows of ``rows`` whose activation in ``s.act`` exceeds
    ``threshold`` into ``s.down_rows``, their activations moved to the front of ``s.act``; returns their count."""
    m = 0
    for i in range(rows.shape[0]):  # without a branch on the choice, as in ``thresholded_input``
        s.down_rows[m] = rows[i]
        s.act[m] = s.act[i]  # position m's own value was read at i = m <= this i
        m += _clears(s.act[m], threshold)
    return m


prepare_cache(globals())  # stale machine code flushed, the rest loaded without the compiler (kernels.numba_cache)
