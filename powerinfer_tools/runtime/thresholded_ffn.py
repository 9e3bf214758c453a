"""A thresholded FFN at run time: CATS (neurons whose |act(gate x)| clears a threshold: SiLU, or GeGLU's GELU),
TEAL (small entries of the FFN's input, and of the down projection's input, dropped) or both. The rules and the
calibrated thresholds of a SiLU or GeGLU model: ``formats/activation_thresholds.py``; calibration:
``profiling/calibration.py``. A ReLU-family layer whose neurons the whole gate chooses (``gate_choice``) runs
as CATS at threshold 0 on relu(gate x): exactly the neurons that fire.

The rules' one test, what a value must clear to be kept, is ``formats.activation_thresholds.clears``: NumPy applies
it here (through ``kept``), the compiled decoder compiles it. The runtime applies it in two places, one per engine,
each for every layer whose plan's choice is thresholded (``ffn_plan.Choice.thresholded``):

* the general path (NumPy, any backend; a prompt or one token): ``ffn``;
* the compiled decoder (one token): ``thresholded_decode.teal_input``, ``cats_choice`` and
  ``drop_small_down_inputs``, called by ``ffn_decode.choose`` and ``ffn``; ``cats_bounds`` (here) turns a CATS
  threshold into the gate values it keeps (``thresholded_decode`` imports numba, which a model on the NumPy
  reference kernels must not load).
"""

from __future__ import annotations

import functools

import numpy as np

from powerinfer_tools import kernels
from powerinfer_tools.formats.activation_thresholds import clears, kept, only, thresholded
from powerinfer_tools.formats.model_spec import FFNKind
from powerinfer_tools.models.layers import gate_activation, gated
from powerinfer_tools.runtime.backends import move
from powerinfer_tools.runtime.ffn_plan import Choice

# --- the general path (NumPy, on any backend)


def ffn(kind: FFNKind, plan, partitions, h, home, host, step, own_neurons, own_up=None, meter=None):
    """The FFN of a thresholded layer (its ``ffn_plan.FFNPlan``) for the tokens ``h`` (on ``home``): TEAL's rule on
    the input, every neuron's gate product, the rules' choice (told to ``meter``, on the host, where given), then
    the kept neurons' up and down rows. One token reads only its kept neurons' rows (those of every neuron under
    TEAL alone); a block of tokens (a prompt, a batch's sequences), where they keep few neurons each (a ReLU
    family's gate: a tenth), each token's own from their up and ``ffn_down_t`` rows alone (``own_neurons``: the
    engine's ``tokens_own_neurons``, None where it does not pay or apply), else the up and down rows of the
    neurons some token kept, masked, in a block short enough for the row kernels (``kernels.MAX_TOKENS``: a
    batch's), or of every neuron in a longer one, whose products the matrix kernels compute faster whole: at the
    densities the SiLU rules keep (half the neurons per token) a prompt's tokens together need nearly every row,
    read once here. A long block of a layer the whole gate chooses for (``own_up``: the engine's
    ``tokens_own_up``, given from ``engine.EVERY_DOWN_ROW_TOKENS``) takes each token's own up products and
    every down row. Returns the output, then the neuron rows and the down rows read."""
    t = plan.thresholds
    h = thresholded(h, t.ffn_in)
    gates = [_gate(kind, t, p, move(h, home, p.backend)) for p in partitions]
    if meter is not None:
        chosen = np.zeros((h.shape[0], plan.d_ff), dtype=bool)
        for p, (_, _, _, kept_here) in zip(partitions, gates):
            chosen[:, p.neurons] = move(kept_here, p.backend, host)
        meter(chosen)
    kept_rows = h.shape[0] <= kernels.MAX_TOKENS and plan.choice is not Choice.TEAL  # TEAL alone keeps every neuron
    out, rows, down_rows = None, 0, 0
    for p, (x, gate_pre, gate, chosen) in zip(partitions, gates):
        computed = int(p.backend.xp.count_nonzero(chosen))
        step.neurons_active += computed
        step.neurons_on_device += computed if p.backend.is_device else 0
        union = p.backend.xp.flatnonzero(chosen.any(axis=0))  # the neurons some token kept
        part, n, up_pre = None, 0, None
        if h.shape[0] > 1 and own_neurons is not None:
            part, n = _own_neurons(kind, t, p, x, gate_pre, chosen, union, own_neurons)
        elif own_up is not None:
            up_pre = own_up(p, x, chosen, gate_pre)
        if part is None:
            part, n = _kept_rows(kind, t, p, x, gate, chosen, union if kept_rows and up_pre is None else None, up_pre)
        rows, down_rows = rows + (n if up_pre is None else len(union)), down_rows + n
        part = move(part, p.backend, home)
        out = part if out is None else out + part
    return out, rows, down_rows


def _gate(kind: FFNKind, t, p, x):
    """Partition ``p``'s input ``x`` (on its backend), every neuron's gate product, its activation (once, for the
    choice and the activations) and the rules' choice ``[T, len(p.neurons)]``."""
    gate_pre, _ = p.pre_activations(x, p.backend.xp.asarray(p.row_of[p.neurons]), up=False)
    gate = gate_activation(kind)(gate_pre)
    return x, gate_pre, gate, kept(gate, t.cats)


def _kept_rows(kind: FFNKind, t, p, x, gate, chosen, union, up_pre=None):
    """Partition ``p``'s output from its gate activations and its rows' up products (``up_pre``: every neuron's,
    where the caller has them, 0 where a token did not keep the neuron): of the neurons some token kept (``union``,
    their indices), else (None) of every neuron; masked where a token did not keep them; and the number of rows
    read."""
    rows = p.backend.xp.asarray(p.row_of[p.neurons])
    if union is not None:
        rows, gate, chosen = rows[union], gate[:, union], None if len(chosen) == 1 else chosen[:, union]
    if up_pre is None:
        _, up_pre = p.pre_activations(x, rows, gate=False)  # the gate's product is given
    elif chosen is not None:
        chosen = None  # masked already: a gated activation of (g, 0) is 0
    activated = gated(kind, gate, up_pre)
    if chosen is not None:
        activated = only(activated, chosen)
    return p.backend.row_sum(p.down_t, thresholded(activated, t.ffn_down), rows), len(rows)


def _own_neurons(kind: FFNKind, t, p, x, gate_pre, chosen, union, own_neurons):
    """A block's partition output from each token's own kept neurons (among ``union``, those some token kept),
    their gate products given, and the rows read (the union's); None where ``own_neurons`` declines (a device's
    partition, among others), or TEAL's rule on the down projection's input is to be applied too."""
    if t.ffn_down is not None or p.backend.is_device:
        return None, 0
    columns = slice(None) if len(union) == chosen.shape[1] else union  # (a prompt's: every neuron, no copies)
    return own_neurons(kind, p, x, p.neurons[columns], chosen, gate_pre, columns), len(union)


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
