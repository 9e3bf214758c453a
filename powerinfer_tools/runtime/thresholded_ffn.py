"""A SiLU model's thresholded FFN at run time: CATS (neurons whose |silu(gate x)| clears a threshold), TEAL
(small entries of the FFN's input, and of the down projection's input, dropped) or both. The rules and the
calibrated thresholds: ``formats/activation_thresholds.py``; calibration: ``profiling/calibration.py``.

Every place the runtime computes these rules is here, for each path that runs them:

* a block of tokens (a prompt), general path: ``block``;
* one token, general path: ``teal_input``, ``cats_choice`` (which neurons), ``teal_down`` (the down
  projection's input, applied by ``FFNPartition.compute``);
* one token, compiled decoder: ``thresholded_input`` and ``drop_small_down_inputs``, called by
  ``compiled_decode.decode_layer``; ``cats_bounds`` turns a CATS threshold into the gate values it keeps.

The module imports numba: the runtime imports it only for a model that has thresholds.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from powerinfer_tools.formats.activation_thresholds import LayerThresholds, kept
from powerinfer_tools.kernels import numba_interleaved
from powerinfer_tools.kernels import numba_kernels as nk
from powerinfer_tools.kernels.numba_kernels import ggml_from_float
from powerinfer_tools.models.layers import silu
from powerinfer_tools.runtime.backends import move

# --- the general path (NumPy, on any backend)


def teal_input(h, t: LayerThresholds, xp):
    """TEAL on the FFN's input ``h``: entries of no larger magnitude than the threshold dropped."""
    return h if t.ffn_in is None else xp.where(kept(h, t.ffn_in), h, 0)


def teal_down(t: LayerThresholds):
    """TEAL on the down projection's input: a function of the activations ``[T, n]`` dropping those of no larger
    magnitude than the threshold (None without one), for ``FFNPartition.compute``."""
    if t.ffn_down is None:
        return None
    return lambda activated, xp: xp.where(kept(activated, t.ffn_down), activated, 0)


def cats_choice(partitions, h, t: LayerThresholds, d_ff: int, home, host, step) -> np.ndarray | None:
    """CATS's choice for the tokens ``h`` (on ``home``): the neurons ``[T, d_ff]`` whose |silu(gate x)| exceeds
    the layer's threshold, from every partition's full gate product (read here, and counted in ``step``);
    None under TEAL alone, which computes every neuron's gate and up."""
    if t.cats is None:
        return None
    chosen = np.zeros((h.shape[0], d_ff), dtype=bool)
    for p in partitions:
        gate_pre, _ = p.pre_activations(move(h, home, p.backend), p.backend.xp.asarray(p.row_of[p.neurons]), up=False)
        chosen[:, p.neurons] = kept(silu(move(gate_pre, p.backend, host)), t.cats)
        step.bytes_read += len(p.neurons) * p.gate.row_bytes
    return chosen


def block(partitions, h, t: LayerThresholds, d_ff: int, home, step):
    """A block of tokens (a prompt; TEAL's input rule already applied): every neuron's gate and up products,
    the rules' mask, one down projection. At the densities these rules keep (half the neurons per token) a
    prompt's tokens together need nearly every row; read once here, where choosing first (``cats_choice``)
    reads the gate twice and goes through per-token selections made for ReLU models' ~10%."""
    out = None
    step.neurons_total += d_ff * h.shape[0]
    for p in partitions:
        xp, rows = p.backend.xp, p.backend.xp.asarray(p.row_of[p.neurons])
        gate_pre, up_pre = p.pre_activations(move(h, home, p.backend), rows)
        gate = silu(gate_pre)  # once, for the choice and the activation (a SiLU model's FFN)
        chosen = kept(gate, t.cats)
        activated = gate * up_pre
        activated = xp.where(chosen & kept(activated, t.ffn_down), activated, 0)
        computed = int(chosen.sum())
        step.neurons_active += computed
        step.neurons_on_device += computed if p.backend.is_device else 0
        step.bytes_read += len(p.neurons) * p.bytes_per_neuron
        part = move(p.backend.row_sum(p.down_t, activated, rows), p.backend, home)
        out = part if out is None else out + part
    return out


# --- the compiled decoder (one token; ``w``: its ``LayerWeights``, ``s``: its ``Scratch``)


def cats_bounds(t: float) -> np.ndarray:
    """float64 ``[above, band_lo, band_hi]``: |silu(g)| > t exactly where g > above or band_lo < g < band_hi.
    silu falls from 0 to its minimum -0.2785 at g = -1.2785 and rises after it, so the first is where
    it climbs past t and the band, where it dips below -t, is empty (0, 0) for larger t."""
    silu = lambda g: g / (1.0 + np.exp(-g))  # noqa: E731

    def root(lo, hi, value):  # silu - value changes sign on [lo, hi]
        rising = silu(hi) > silu(lo)
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if (silu(mid) < value) == rising else (lo, mid)
        return (lo + hi) / 2

    bottom = -1.2784645427610738  # silu's argmin, -1 - W(1/e)
    t = float(t)
    above = root(bottom, t + 20.0, t)
    if t >= -silu(bottom):
        return np.array([above, 0.0, 0.0])
    return np.array([above, root(-100.0, bottom, -t) if t > 0 else -np.inf, root(bottom, 0.0, -t)])


@njit(inline="always")
def _cats_keeps(g, t, bounds):
    """|silu(g)| > t, by comparing g with ``bounds`` (``cats_bounds(t)``): no exp, except within 1e-6 of
    a bound, where the comparison gives way to the definition itself."""
    for b in bounds:
        if abs(g - b) < 1e-6:
            return abs(nk.silu(g)) > t
    return g > bounds[0] or bounds[1] < g < bounds[2]


@njit(nogil=True, cache=True)
def thresholded_input(w, s, fns, n_threads):
    """A thresholded layer's FFN input, encoded in ``s.x_encoded``, and its neurons to compute in
    ``s.active``; returns their count. TEAL (``ffn_in``) first drops the input's small entries; CATS
    computes the gate product of every neuron (into ``s.predicted``, by row) and keeps those whose
    |silu| exceeds the threshold; without CATS every neuron is computed."""
    d_model, d_ff = s.h.shape[0], w.up.shape[0]
    if w.ffn_in >= 0:
        for i in range(d_model):
            if abs(s.h[i]) <= w.ffn_in:
                s.h[i] = 0.0
    ggml_from_float(fns[w.ffn_type, 0], s.h.ctypes.data, s.x_encoded.ctypes.data, d_model)
    if w.cats < 0:
        s.active[:d_ff] = s.all_rows[:d_ff]
        return d_ff
    whole_gate(w, s, d_model, fns, n_threads)
    n = 0
    for neuron in range(d_ff):
        if _cats_keeps(s.predicted[neuron], w.cats, w.cats_bounds):
            s.active[n] = neuron
            n += 1
    return n


@njit(nogil=True, cache=True)
def whole_gate(w, s, d_model, fns, n_threads):
    """Every neuron's gate product into ``s.predicted`` from the encoded input."""
    if w.gate_gemv:
        numba_interleaved.gemv(w.gate_gemv, w.gate, s.x_encoded, d_model, s.predicted, n_threads, w.vnni)
    else:
        nk.matvec(fns[w.ffn_type, 1], w.gate, s.x_encoded, d_model, s.predicted)


@njit(nogil=True, cache=True)
def drop_small_down_inputs(s, rows, threshold):
    """TEAL on the down projection's input: the rows of ``rows`` whose activation in ``s.act`` exceeds
    ``threshold`` into ``s.down_rows``, their activations moved to the front of ``s.act``; returns their count."""
    m = 0
    for i in range(rows.shape[0]):
        if abs(s.act[i]) > threshold:
            s.down_rows[m] = rows[i]
            s.act[m] = s.act[i]
            m += 1
    return m
