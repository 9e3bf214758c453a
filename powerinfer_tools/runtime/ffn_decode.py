"""The compiled decoder's FFN for one token (``runtime/compiled_decode.py`` runs it as part of a layer's call), as
the layer's plan for the mode says (``runtime/ffn_plan.py``; ``LayerWeights``' ``choice`` and ``gate_up``, numbered
below, and its thresholds): which neurons it computes (``choose``: every one, the predictor's from ``predict``, or
CATS's from every gate product, through ``thresholded_decode``), their gate and up products with the activation
(``gate_up`` from their rows, or given where the plan computes gate, or gate and up, whole: ``whole_products``),
the down projection (``down``: an axpy over ``ffn_down_t``'s rows, those TEAL keeps, or a dense file's matrix),
and the variants built from those: a layer's FFN (``choose`` then ``ffn``), one routed expert of a mixture
(``expert_ffn``, weighted by ``compiled_decode.Mixture``) and a layer whose rows are a neuron cache's
(``cached_ffn``). A change to the arithmetic of one of them is made here; the general path's counterparts are
``runtime/engine.py`` (``RuntimeModel._ffn``) with ``runtime/ffn.py``, ``runtime/thresholded_ffn.py`` and
``runtime/neuron_cache.py``.

``w`` is a layer's ``compiled_decode.LayerWeights``, ``s`` the decoder's ``Scratch``, ``fns`` the from_float and
vec_dot addresses by weight type.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from powerinfer_tools.formats.predictor_rule import chooses, hidden_layer
from powerinfer_tools.formats.weight_types import WEIGHT_TYPES
from powerinfer_tools.kernels import numba_interleaved, numba_vnni
from powerinfer_tools.kernels import numba_kernels as nk
from powerinfer_tools.kernels.numba_kernels import (PREFETCH_ROWS, ggml_from_float, ggml_vec_dot, in_order,
                                                    prefetch_span)
from powerinfer_tools.runtime.neuron_cache import NeuronCache, stream_in_order
from powerinfer_tools.runtime.thresholded_decode import cats_choice, drop_small_down_inputs, teal_input
from powerinfer_tools.kernels.numba_cache import prepare_cache

# A layer's plan (``ffn_plan``) as numbers, in its ``LayerWeights`` (``compiled_decode`` maps the plan's enums):
# which neurons it computes (``choice``: every one, TEAL alone's too; the predictor's; CATS's or the whole gate's,
# from every gate product) ...
CHOOSE_EVERY, CHOOSE_PREDICTED, CHOOSE_BY_GATE = 0, 1, 2
# ... and how their gate and up products are made (``gate_up``): from their rows; the gate computed whole (its
# products in the scratch's ``predicted``, by row), up from their rows; both computed whole (up's in ``up_out``).
GATE_UP_ROWS, GATE_WHOLE, GATE_UP_WHOLE = 0, 1, 2
_Q4_0_BLOCK_BYTES = WEIGHT_TYPES[nk.Q4_0].block_bytes
# The predictor's rule as NumPy applies it to arrays (``formats.predictor_rule``), compiled for one value.
_hidden_layer = njit(inline="always")(hidden_layer)
_chooses = njit(inline="always")(chooses)


@njit(parallel=True, nogil=True, cache=True, **nk.FAST_FLOATS)
def _gate_up(vec_dot, gate, up, rows, at, x_encoded, cols, kind, given, gate_out, up_out, act, gate_given, x_vnni):
    """``act[at[i]]`` = the activated value of the neuron in row ``rows[i]`` from its gate and up rows, in
    one loop (``at`` places the values: a cached layer computes its resident neurons first). ``given``: the gate
    products are ``gate_given[row]`` and only the up rows are read. A non-empty ``x_vnni`` (the input as
    ``numba_vnni.encode`` writes it) takes q4_0 rows through ``numba_vnni.row_dot_q4_0`` instead of ggml's
    ``vec_dot``."""
    # gate and up rows are alike, unless the gate is given (then it may be interleaved: never read here)
    n, row_bytes, xe = rows.shape[0], up.strides[0], x_encoded.ctypes.data
    vnni_groups = cols // numba_vnni.GROUP_COLS if x_vnni.shape[0] else 0
    order = in_order(rows)
    for i in prange(n):
        row, j, ahead = rows[i] * row_bytes, at[i], rows[min(i + PREFETCH_ROWS, n - 1)] * row_bytes
        if i + PREFETCH_ROWS < n and not vnni_groups:  # (row_dot asks for its own) scattered rows: none else can
            if not given:
                prefetch_span(gate.ctypes.data + ahead, row_bytes, order)
            prefetch_span(up.ctypes.data + ahead, row_bytes, order)
        if given:
            gate_out[j] = gate_given[rows[i]]
        else:
            _row_product(vec_dot, cols, gate_out, j, gate.ctypes.data, row, ahead, order, xe, x_vnni, vnni_groups)
        _row_product(vec_dot, cols, up_out, j, up.ctypes.data, row, ahead, order, xe, x_vnni, vnni_groups)
        act[j] = nk.gated_activation(kind, gate_out[j], up_out[j])


@njit(inline="always")
def _row_product(vec_dot, cols, out, j, matrix, row, ahead, order, xe, x_vnni, vnni_groups):
    """``out[j]`` = the row at byte ``row`` of ``matrix`` (an address) times the input (see ``_gate_up``);
    ``row_dot`` also asks for the row at byte ``ahead`` (rows read in order or not: ``order``). With
    ``vnni_groups`` it takes the row's first ``vnni_groups`` groups of ``numba_vnni.GROUP_COLS``, and ggml's
    ``vec_dot`` the blocks after them (a width not a whole number of groups: SmolLM2's 576 is four groups and
    two blocks)."""
    if vnni_groups:
        total = numba_vnni.row_dot_q4_0_rows(matrix + row, x_vnni.ctypes.data, vnni_groups, matrix + ahead, order)
        done = vnni_groups * numba_vnni.GROUP_COLS
        if done < cols:
            blocks = done // nk.BLOCK
            ggml_vec_dot(vec_dot, cols - done, out.ctypes.data + 4 * j, matrix + row + blocks * _Q4_0_BLOCK_BYTES,
                         xe + blocks * numba_vnni.Q8_0_BLOCK_BYTES)
            total += out[j]
        out[j] = total
    else:
        ggml_vec_dot(vec_dot, cols, out.ctypes.data + 4 * j, matrix + row, xe)


# A predictor matrix smaller than this is multiplied on one thread: a fork/join of the thread pool costs
# more than the rows (hidden size 8 at d_ff 5632 in f16: 90 KB).
PARALLEL_PREDICTOR_BYTES = 256 * 1024


@njit(nogil=True, cache=True)
def _matvec_serial(vec_dot, w, x_encoded, cols, out):
    """``out = W · x`` over all rows of ``w``, on the calling thread."""
    for i in range(w.shape[0]):
        ggml_vec_dot(vec_dot, cols, out.ctypes.data + 4 * i, w.ctypes.data + i * w.strides[0], x_encoded.ctypes.data)


# Narrower f16 predictor rows than this skip ggml's vec_dot (``nk.f16_row_dot``).
NARROW_F16_COLS = 64


@njit(nogil=True, cache=True)
def _predictor_product(from_float, vec_dot, w, w_type, x, x_encoded, out):
    """``out = W · x`` with ``w`` in its stored type: x encoded for ``vec_dot``, rows as the weights' are
    (narrow f16 rows: ``nk.f16_row_dot``, which rounds x to f16 itself, as ggml's encoding would)."""
    cols = x.shape[0]
    if nk.claimed(nk.NARROW_ROW_DOT_TYPES, w_type) and cols <= NARROW_F16_COLS and cols % nk.F16_CHUNK == 0:
        for i in range(w.shape[0]):
            out[i] = nk.f16_row_dot(w.ctypes.data + i * w.strides[0], x.ctypes.data, cols)
        return
    ggml_from_float(from_float, x.ctypes.data, x_encoded.ctypes.data, cols)
    if w.size >= PARALLEL_PREDICTOR_BYTES:
        nk.matvec(vec_dot, w, x_encoded, cols, out)
    else:
        _matvec_serial(vec_dot, w, x_encoded, cols, out)


@njit(nogil=True, cache=True)
def predict(x, w, s, fns):
    """Neurons whose predictor output ``fc2 · relu(fc1 · x)`` reaches the threshold (the rule:
    ``formats.predictor_rule``), into ``s.active``; returns their count. Both products read the predictor in
    its stored type."""
    hidden = s.hidden[: w.fc1.shape[0]]
    _predictor_product(fns[w.fc1_type, 0], fns[w.fc1_type, 1], w.fc1, w.fc1_type, x, s.x_encoded, hidden)
    for i in range(hidden.shape[0]):
        hidden[i] = _hidden_layer(hidden[i])
    _predictor_product(fns[w.fc2_type, 0], fns[w.fc2_type, 1], w.fc2, w.fc2_type, hidden, s.x_encoded,
                       s.predicted)
    n = 0
    for neuron in range(w.fc2.shape[0]):  # without a branch on the choice (``thresholded_decode.thresholded_input``)
        s.active[n] = neuron
        n += _chooses(s.predicted[neuron], w.threshold)
    return n


@njit(inline="always")
def rows_take_vnni(vnni, ffn_type, cols):
    """Whether ``gate_up`` multiplies gate/up rows of ggml type ``ffn_type``, ``cols`` wide, with
    ``numba_vnni.row_dot_q4_0`` (``vnni``: this CPU runs it; ``ffn_type``: a type that claims
    ``Kernel.VNNI_GATE_UP``, q4_0) rather than ggml's ``vec_dot``; the execution report asks too (``.py_func``).
    Up is never interleaved here: its rows are q4_0 as stored when ``ffn_type`` says q4_0."""
    return vnni and nk.claimed(numba_vnni.GATE_UP_TYPES, ffn_type) and cols >= numba_vnni.GROUP_COLS


@njit(nogil=True, cache=True)
def gate_up(w, s, rows, at, given, fns):
    """``s.act[at[i]]`` for the neurons in rows ``rows`` of the layer's gate and up (the input encoded
    in ``s.x_encoded``; ``given``: the gate's products computed whole, in ``s.predicted``)."""
    d_model = s.h.shape[0]
    rows_vnni = rows_take_vnni(w.vnni, w.ffn_type, d_model)
    x_vnni = s.x_vnni if rows_vnni else s.x_vnni[:0]
    if rows_vnni:
        numba_vnni.encode(nk.Q4_0, s.x_encoded, x_vnni, d_model)
    _gate_up(fns[w.ffn_type, 1], w.gate, w.up, rows, at, s.x_encoded, d_model, w.kind, given, s.gate_out, s.up_out,
             s.act, s.predicted, x_vnni)


@njit(nogil=True, cache=True)
def down(x, w, s, rows, fns, n_threads):
    """Add the down projection of ``s.act[:len(rows)]`` (neurons in rows ``rows``) to the residual ``x``."""
    n, d_model = rows.shape[0], x.shape[0]
    act = s.act[:n]
    if w.down_transposed:  # ffn_down_t [d_ff, d_model]: add the active rows, weighted, to x
        nk.axpy_rows_one_token(w.down_type, w.down, rows, act.reshape((1, n)), x.reshape((1, d_model)), n_threads)
    else:  # a dense file's ffn_down [d_model, d_ff] (dense mode only): row dots with the activations
        ggml_from_float(fns[w.down_type, 0], act.ctypes.data, s.x_encoded.ctypes.data, n)
        if w.down_gemv:
            numba_interleaved.gemv(w.down_gemv, w.down, s.x_encoded, n, s.o, n_threads, w.vnni)
        else:
            nk.matvec(fns[w.down_type, 1], w.down, s.x_encoded, n, s.o)
        x += s.o


@njit(nogil=True, cache=True)
def choose(x, w, s, fns, n_threads):
    """The neurons a layer's FFN computes for one token, as its plan says (``w.choice``): every one, the
    predictor's (from the residual ``x``, the stream entering the FFN block, as PowerInfer's runtime feeds it) or
    CATS's (from every gate product), into ``s.active``; returns their count. On the way, the normed input ``s.h``
    (TEAL's rule applied, where the plan has it) is encoded in ``s.x_encoded``, and the products the plan computes
    whole (``w.gate_up``) are made."""
    d_model, n = s.h.shape[0], s.act.shape[0]  # (up may be interleaved: not its rows)
    if w.choice == CHOOSE_PREDICTED:
        n = predict(x, w, s, fns)  # before the input is encoded: it encodes x in the same buffer
    if w.ffn_in >= 0:
        teal_input(s.h, w.ffn_in)
    ggml_from_float(fns[w.ffn_type, 0], s.h.ctypes.data, s.x_encoded.ctypes.data, d_model)
    if w.gate_up != GATE_UP_ROWS:
        whole_products(w, s, d_model, fns, n_threads)
    if w.choice == CHOOSE_BY_GATE:
        n = cats_choice(w, s)
    return n


@njit(nogil=True, cache=True)
def whole_products(w, s, d_model, fns, n_threads):
    """Every neuron's gate product into ``s.predicted`` from the encoded input; where the plan computes up whole
    too (interleaved beside the gate: a layer that computes most neurons, or a dense file's), every up product
    into ``s.up_out`` in the same parallel loop."""
    if w.gate_up == GATE_UP_WHOLE:
        numba_interleaved.gemv_fused(w.up_gemv, w.gate, w.up, numba_interleaved.NO_GROUPS, s.x_encoded, d_model,
                                     s.predicted, s.up_out, s.o[:0], n_threads, w.vnni)
    elif w.gate_gemv:
        numba_interleaved.gemv(w.gate_gemv, w.gate, s.x_encoded, d_model, s.predicted, n_threads, w.vnni)
    else:
        nk.matvec(fns[w.ffn_type, 1], w.gate, s.x_encoded, d_model, s.predicted)


@njit(nogil=True, cache=True)
def ffn(x, w, s, n, fns, n_threads):
    """Add the FFN's output for the ``n`` neurons ``choose`` chose to ``x``; returns the number of neurons
    computed and of down rows read."""
    rows = activations(w, s, n, fns)
    return n, down_of_activations(x, w, s, rows, fns, n_threads)


@njit(nogil=True, cache=True)
def expert_ffn(out, residual, w, s, fns, n_threads):
    """One routed expert of a mixture for one token (``w``: its FFN and predictor, and plan): its neurons from the
    normed input ``s.h``, the down projection added to ``out`` (zeros: the expert's output, which ``Mixture``
    weights). The predictor reads ``residual``, the stream entering the FFN block. Returns the number of neurons
    computed."""
    return ffn(out, w, s, choose(residual, w, s, fns, n_threads), fns, n_threads)[0]


@njit(nogil=True, cache=True)
def activations(w, s, n, fns):
    """The activated values ``s.act[:n]`` of the ``n`` neurons ``choose`` chose; returns their rows."""
    rows = s.all_rows[:n] if w.choice == CHOOSE_EVERY else s.active[:n]
    if w.gate_up == GATE_UP_WHOLE:  # the chosen neurons' activations from every gate and up product
        _given_activations(s, rows, w.kind)
    else:
        gate_up(w, s, rows, s.all_rows[:n], w.gate_up == GATE_WHOLE, fns)
    return rows


@njit(nogil=True, cache=True)
def down_of_activations(x, w, s, rows, fns, n_threads):
    """Add the down projection of the activations ``s.act`` of the neurons in ``rows`` to ``x`` (those TEAL keeps,
    where the plan has its rule on the down projection's input); returns the number of down rows read."""
    if w.ffn_down >= 0:
        m = drop_small_down_inputs(s, rows, w.ffn_down)
        down(x, w, s, s.down_rows[:m], fns, n_threads)
        return m
    down(x, w, s, rows, fns, n_threads)
    return rows.shape[0]


@njit(nogil=True, cache=True, **nk.FAST_FLOATS)
def _given_activations(s, rows, kind):
    """``s.act[i]``: the activated value of the neuron in row ``rows[i]`` from every neuron's gate and up
    products (``s.predicted``, ``s.up_out``, by row)."""
    for i in range(rows.shape[0]):
        s.act[i] = nk.gated_activation(kind, s.predicted[rows[i]], s.up_out[rows[i]])


def cached_ffn(x, w, s, cache: NeuronCache, active: np.ndarray, fns, n_threads: int) -> None:
    """The FFN of a layer whose rows are a neuron cache's, for the ``active`` neurons (its plan: a predictor's
    choice, gate and up from rows): gate and up of the resident ones run while the misses are read, then the
    misses', then one down projection over all, in neuron order. A step needing more misses than the cache has
    free slots streams them through it (``stream_in_order``), range by range in neuron order, each range's down
    rows into the partial sums of one down projection: either way the sum is the one computed without the cache."""
    resident = cache.resident(active)
    missing = np.flatnonzero(~resident)
    if len(missing) > cache.capacity - np.count_nonzero(cache.row_of[active[resident]] >= cache.n_pinned):
        partial = nk.row_partials(len(active), 1, x.shape[0], n_threads)
        for first, stop in stream_in_order(cache, active):
            _range_ffn(w, s, cache.row_of[active[first:stop]], first, len(active), partial, fns)
        nk.add_partials(partial, x.reshape((1, -1)))
        return
    cache.new_step(active[resident])
    wait = cache.load(active[missing])
    present = np.flatnonzero(resident)
    gate_up(w, s, cache.row_of[active[present]], present, False, fns)
    wait()
    gate_up(w, s, cache.row_of[active[missing]], missing, False, fns)
    down(x, w, s, cache.row_of[active], fns, n_threads)


@njit(nogil=True, cache=True)
def _range_ffn(w, s, rows, first, total, partial, fns):
    """Gate, up and the down product of the neurons at positions ``first ..`` of ``total`` (their rows
    ``rows``), the down rows into the partial sums of the whole down projection (``ffn_down_t``: a
    neuron cache holds transposed rows)."""
    n = rows.shape[0]
    at = np.arange(first, first + n)
    gate_up(w, s, rows, at, False, fns)
    nk.axpy_rows_one_token_part(w.down_type, w.down, rows, s.act[first : first + n].reshape((1, n)), partial, first,
                                total)


prepare_cache(globals())  # stale machine code flushed, the rest loaded without the compiler (kernels.numba_cache)
