"""A thresholded FFN at run time: CATS (neurons whose |act(gate x)| clears a threshold: SiLU, or GeGLU's GELU),
TEAL (small entries of the FFN's input, and of the down projection's input, dropped) or both. The rules and the
calibrated thresholds of a SiLU or GeGLU model: ``formats/activation_thresholds.py``; calibration:
``profiling/calibration.py``. A ReLU-family layer whose neurons the whole gate chooses (``gate_choice``) runs
as CATS at threshold 0 on relu(gate x): exactly the neurons that fire.

The rules' one test, what a value must clear to be kept, is ``formats.activation_thresholds.clears``: NumPy applies
it here (through ``kept``), the compiled decoder compiles it. Every place the runtime applies it is here or, for
the compiled decoder, in ``thresholded_decode`` (whose numba loops a model on the NumPy reference kernels must not
import):

* a block of tokens (a prompt), general path: ``block``;
* one token, general path: ``teal_input``, ``cats_choice`` (which neurons), ``teal_down`` (the down
  projection's input, applied by ``FFNPartition.compute``);
* one token, compiled decoder: ``thresholded_decode.thresholded_input`` and ``drop_small_down_inputs``,
  called by ``compiled_decode.decode_layer``; ``cats_bounds`` (here) turns a CATS threshold into the gate values
  it keeps.
"""

from __future__ import annotations

import functools

import numpy as np

from powerinfer_tools.formats.activation_thresholds import LayerThresholds, clears, kept, only, thresholded
from powerinfer_tools.formats.model_spec import FFNKind
from powerinfer_tools.models.layers import gate_activation, gated
from powerinfer_tools.runtime.backends import move

# --- the general path (NumPy, on any backend)


def teal_input(h, t: LayerThresholds):
    """TEAL on the FFN's input ``h``: entries of no larger magnitude than the threshold dropped."""
    return thresholded(h, t.ffn_in)


def teal_down(t: LayerThresholds):
    """TEAL on the down projection's input: a function of the activations ``[T, n]`` dropping those of no larger
    magnitude than the threshold (None without one), for ``FFNPartition.compute``."""
    if t.ffn_down is None:
        return None
    return lambda activated: thresholded(activated, t.ffn_down)


def cats_choice(kind: FFNKind, partitions, h, t: LayerThresholds, d_ff: int, home, host, step) -> np.ndarray | None:
    """CATS's choice for the tokens ``h`` (on ``home``): the neurons ``[T, d_ff]`` whose |gate activation| exceeds
    the layer's threshold, from every partition's full gate product (read here, and counted in ``step``);
    None under TEAL alone, which computes every neuron's gate and up."""
    if t.cats is None:
        return None
    chosen = np.zeros((h.shape[0], d_ff), dtype=bool)
    for p in partitions:
        gate_pre, _ = p.pre_activations(move(h, home, p.backend), p.backend.xp.asarray(p.row_of[p.neurons]), up=False)
        chosen[:, p.neurons] = kept(gate_activation(kind)(move(gate_pre, p.backend, host)), t.cats)
        step.bytes_read += len(p.neurons) * p.gate.row_bytes
    return chosen


def block(kind: FFNKind, partitions, h, t: LayerThresholds, d_ff: int, home, step, own_neurons):
    """A block of tokens (a prompt; TEAL's input rule already applied): every neuron's gate product, the rules'
    mask, then where the tokens keep few neurons each (a ReLU family's gate: a tenth) each token's own from their
    up and ``ffn_down_t`` rows alone (``own_neurons``: the engine's ``tokens_own_neurons``, None where it does
    not pay or apply), else every neuron's up and one down projection. At the densities the SiLU rules keep (half
    the neurons per token) a prompt's tokens together need nearly every row: read once here."""
    out = None
    step.neurons_total += d_ff * h.shape[0]
    for p in partitions:
        xp, rows = p.backend.xp, p.backend.xp.asarray(p.row_of[p.neurons])
        x = move(h, home, p.backend)
        gate_pre, _ = p.pre_activations(x, rows, up=False)
        gate = gate_activation(kind)(gate_pre)  # once, for the choice and (below) the activations
        chosen = kept(gate, t.cats)
        computed = int(xp.count_nonzero(chosen))
        step.neurons_active += computed
        step.neurons_on_device += computed if p.backend.is_device else 0
        part = _own_neurons(kind, p, x, gate_pre, chosen, t, own_neurons, step)
        if part is None:
            _, up_pre = p.pre_activations(x, rows, gate=False)  # the gate's product is above
            activated = gated(kind, gate, up_pre)
            activated = thresholded(only(activated, chosen), t.ffn_down)
            step.bytes_read += len(p.neurons) * p.bytes_per_neuron
            part = p.backend.row_sum(p.down_t, activated, rows)
        part = move(part, p.backend, home)
        out = part if out is None else out + part
    return out


def _own_neurons(kind: FFNKind, p, x, gate_pre, chosen, t: LayerThresholds, own_neurons, step):
    """``block``'s partition output from each token's own chosen neurons, their gate products given; None where
    ``own_neurons`` declines (a device's partition, among others), or TEAL's rule on the down projection's input
    is to be applied too."""
    if t.ffn_down is not None or p.backend.is_device:
        return None
    used = chosen.any(axis=0)
    # every neuron chosen by some token (a prompt at the rules' densities): views, not copies of the block
    union = slice(None) if used.all() else np.flatnonzero(used)
    ids = p.neurons[union]
    out = own_neurons(kind, p, x, ids, chosen[:, union], gate_pre[:, union])
    if out is not None:
        step.bytes_read += len(p.neurons) * p.gate.row_bytes + len(ids) * (p.bytes_per_neuron - p.gate.row_bytes)
    return out


# --- the compiled decoder's thresholds (its loops: ``thresholded_decode``)


def cats_bounds(t: float, kind: FFNKind = FFNKind.SWIGLU) -> np.ndarray:
    """float64 ``[above, band_lo, band_hi, margin]``: act(g) clears t (``clears``) exactly where g > above or
    band_lo < g < band_hi, up to ``margin`` (``thresholded_decode``). SiLU and GELU fall from 0 to one minimum
    (SiLU's -0.2785 at g = -1.2785, GELU's -0.170 at g = -0.752) and rise after it: the first bound is where the
    activation climbs past t, and the band, where it dips past -t, is empty (0, 0) where the minimum does not
    clear t. Each bound is bisected on ``clears`` itself, so a change to the rules' test moves them too (a test
    keeping one interval of each side of the minimum). (A ReLU family's relu needs none: the decoder computes
    it.)"""
    act, bottom = _scalar_activation(kind), _minimum(kind)
    t = float(t)

    def keeps(g):
        return bool(clears(act(g), t))

    def bisect(lo, hi):  # the boundary on [lo, hi] of where ``keeps`` holds, holding at lo or at hi
        first = keeps(lo)
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if keeps(mid) == first else (lo, mid)
        return (lo + hi) / 2

    above = bisect(0.0, t + 20.0)  # act(0) = 0, which no threshold of 0 or more keeps
    if not keeps(bottom):
        return np.array([above, 0.0, 0.0, THRESHOLD_MARGIN])
    # the band's far end: where act is back within t (GELU reaches 0 exactly in float64, SiLU never does)
    band_lo = bisect(-100.0, bottom) if not keeps(-100.0) else -np.inf
    return np.array([above, band_lo, bisect(bottom, 0.0), THRESHOLD_MARGIN])


def _scalar_activation(kind: FFNKind):
    activation = gate_activation(kind)
    return lambda g: float(activation(np.float64(g)))


@functools.cache
def _minimum(kind: FFNKind) -> float:
    """Where the gate activation (SiLU, GELU) is lowest, by ternary search: it falls to there and rises after.
    Once per kind, not per layer."""
    act = _scalar_activation(kind)
    lo, hi = -20.0, 0.0
    for _ in range(200):
        a, b = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        lo, hi = (lo, b) if act(a) < act(b) else (a, hi)
    return (lo + hi) / 2


THRESHOLD_MARGIN = 1e-6  # how near a bound float32 rounding can put the bisected root on the wrong side of g
