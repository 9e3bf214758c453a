"""A sparse FFN for a block of tokens (a prompt): each token computes only the neurons it selected.

The predictor picks ~12% of a layer's neurons per token, but over a 128-token prompt the union is
nearly all of them, and multiplying every token by the union (``runtime/backends.py``'s block
products: weight rows dequantized, then BLAS) does ~8x the work the predictor asked for. Here a
selected neuron's gate and up rows are read once and dotted with just the tokens that selected it,
on x encoded once per token, as decoding does (so a prompt's rounding is a decoded token's):
``numba_vnni.row_dot`` where the rows take it (``numba_vnni.usable``), else ggml's ``vec_dot``; the down
projection then reads each selected row of ``ffn_down_t`` once too and
adds it, weighted, to the outputs of the tokens that selected it (``axpy_selected``, the decoding
kernel's block arithmetic: a token's sum is the one decoding computes, in the same row order). A long block whose
whole gate chooses (``runtime.thresholded_ffn``) takes its tokens' up products alone (``selected_up``): every row
of its down projection is then read, faster by the matrix kernels than by ``axpy_selected`` from there.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from powerinfer_tools import kernels
from powerinfer_tools.formats.model_spec import FFNKind
from powerinfer_tools.kernels.numba_kernels import (
    PREFETCH_ROWS,
    axpy_selected,
    axpy_takes,
    ggml_from_float,
    ggml_vec_dot,
    in_order,
    prefetch_span,
    use_threads,
)
from powerinfer_tools.kernels import numba_vnni
from powerinfer_tools.kernels.numba_vnni import row_dot
from powerinfer_tools.kernels.quant import QuantMatrix
from powerinfer_tools.models.layers import activate
from powerinfer_tools.kernels.numba_cache import prepare_cache


@njit(parallel=True, nogil=True, cache=True)
def _selected_dots(routines, gate, up, rows, starts, tokens, x, x_q8_0, x_encoded, gate_out, up_out, gate_given):
    """``gate_out[t, i] = gate[rows[i]] · x[t]`` and ``up_out`` likewise, for the tokens
    ``t in tokens[starts[i]:starts[i + 1]]`` that selected neuron i; other entries are left alone. With
    ``gate_given`` only ``up_out`` is computed (``gate`` is not read). ``routines``: ggml's ``from_float`` and
    ``vec_dot`` addresses, and the ggml type of ``numba_vnni.row_dot`` (-1: ``vec_dot`` computes the products,
    on ggml's encoding of x in ``x_encoded``; else that encoding goes to the scratch ``x_q8_0``, and
    ``numba_vnni.encode``'s to ``x_encoded``)."""
    from_float, vec_dot, vnni = routines
    n_tokens, cols = x.shape
    if vnni >= 0:
        numba_vnni.encode_tokens(vnni, from_float, x, x_q8_0, x_encoded)
    else:
        for t in prange(n_tokens):
            ggml_from_float(from_float, x[t].ctypes.data, x_encoded[t].ctypes.data, cols)
    row_bytes, xe, xe_stride = up.strides[0], x_encoded.ctypes.data, x_encoded.strides[0]
    g_out, u_out, out_stride = gate_out.ctypes.data, up_out.ctypes.data, gate_out.strides[0]
    n_rows, order = rows.shape[0], in_order(rows)
    for i in prange(n_rows):
        ahead = rows[min(i + PREFETCH_ROWS, n_rows - 1)] * row_bytes
        if i + PREFETCH_ROWS < n_rows:  # tell the cache which rows come next (scattered ones: the prefetcher cannot)
            if not gate_given:
                prefetch_span(gate.ctypes.data + ahead, row_bytes, order)
            prefetch_span(up.ctypes.data + ahead, row_bytes, order)
        g_row, u_row = gate.ctypes.data + rows[i] * row_bytes, up.ctypes.data + rows[i] * row_bytes
        for k in range(starts[i], starts[i + 1]):  # the row stays in L1 for all of its tokens
            t = tokens[k]
            if vnni >= 0:  # row_dot's own hints for the next row too: spread over its work, they pay beside those above
                if not gate_given:
                    gate_out[t, i] = row_dot(vnni, g_row, xe + t * xe_stride, cols, gate.ctypes.data + ahead, order)
                up_out[t, i] = row_dot(vnni, u_row, xe + t * xe_stride, cols, up.ctypes.data + ahead, order)
            else:
                if not gate_given:
                    ggml_vec_dot(vec_dot, cols, g_out + t * out_stride + 4 * i, g_row, xe + t * xe_stride)
                ggml_vec_dot(vec_dot, cols, u_out + t * out_stride + 4 * i, u_row, xe + t * xe_stride)


def handles(gate: QuantMatrix | None, up: QuantMatrix, down_t: QuantMatrix | None, gate_given: bool = False) -> bool:
    """Whether ``selected_ffn`` computes an FFN with these matrices: a gated one whose down projection
    is stored neuron-major in a type the axpy decodes, gate and up of one type in rows as stored (not
    interleaved, as a gate that chooses is: ``runtime.gate_choice``; with ``gate_given`` the gate is not
    read), with the compiled kernels loaded."""
    return (gate is not None and (gate_given or (isinstance(gate, QuantMatrix) and gate.qtype == up.qtype))
            and isinstance(up, QuantMatrix) and down_t is not None and kernels.available()
            and axpy_takes(down_t.qtype, down_t.cols))


def selected_ffn(kind: FFNKind, gate: QuantMatrix, up: QuantMatrix, down_t: QuantMatrix, rows: np.ndarray,
                 x: np.ndarray, mask: np.ndarray, gate_pre: np.ndarray | None = None) -> np.ndarray:
    """FFN output ``[T, d_model]`` of ``x [T, d_model]`` where token t computes the neurons at ``rows[i]``
    for which ``mask[t, i]`` is set, and no others (``handles`` must be true); ``gate_pre [T, len(rows)]``:
    their gate products, already computed (the gate is then not read)."""
    grouped = _by_neuron(mask)
    gate_out, up_out = _products(gate, up, rows, x, grouped, gate_pre)
    activated = activate(kind, gate_out, up_out)  # 0 where not selected: every gated activation of (g, 0) is 0
    out = kernels.axpy_output(len(x), down_t.cols)
    axpy_selected(int(down_t.qtype), kernels.weight_bytes(down_t), np.ascontiguousarray(rows, dtype=np.intp),
                  *grouped, activated, out, kernels.get_threads())
    return out


def selected_up(up: QuantMatrix, rows: np.ndarray, x: np.ndarray, mask: np.ndarray,
                gate_pre: np.ndarray) -> np.ndarray:
    """``up[rows[i]] · x[t]`` ``[T, len(rows)]`` where ``mask[t, i]`` is set, 0 elsewhere (``handles`` with the gate
    given must be true): a long block's up products, whose down projection then reads every row
    (``runtime.thresholded_ffn``)."""
    return _products(None, up, rows, x, _by_neuron(mask), gate_pre)[1]


def _by_neuron(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``mask [T, n]``'s set entries grouped by neuron: ``(starts [n + 1], tokens)``, neuron i's tokens (ascending)
    at ``tokens[starts[i]:starts[i + 1]]``."""
    starts = np.zeros(mask.shape[1] + 1, dtype=np.intp)
    tokens = np.empty(np.count_nonzero(mask), dtype=np.intp)
    _group_by_neuron(np.ascontiguousarray(mask, dtype=np.bool_), starts, tokens)
    return starts, tokens


@njit(nogil=True, cache=True)
def _group_by_neuron(mask, starts, tokens):
    """``_by_neuron``'s two passes over the mask in its own order (NumPy's ``nonzero`` of its transpose took half
    of a long block's up products)."""
    n_tokens, n = mask.shape
    for t in range(n_tokens):
        for i in range(n):
            starts[i + 1] += mask[t, i]
    for i in range(n):
        starts[i + 1] += starts[i]
    at = starts[:-1].copy()
    for t in range(n_tokens):
        for i in range(n):
            if mask[t, i]:
                tokens[at[i]] = t
                at[i] += 1


def _products(gate: QuantMatrix | None, up: QuantMatrix, rows: np.ndarray, x: np.ndarray, grouped,
              gate_pre: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The gate (``gate_pre`` where given) and up products ``[T, len(rows)]`` of the (neuron, token) pairs
    ``grouped`` (``_by_neuron``), 0 elsewhere (``_selected_dots``)."""
    n_tokens, n = len(x), len(rows)
    rows = np.ascontiguousarray(rows, dtype=np.intp)
    routine = kernels.ggml_routines().routines[up.qtype]
    x = np.ascontiguousarray(x, dtype=np.float32)
    ggml_encoded = np.empty((n_tokens, routine.encoded_bytes(up.cols)), dtype=np.uint8)
    vnni = int(up.qtype) if numba_vnni.usable(int(up.qtype), up.cols) else -1
    x_encoded = np.empty((n_tokens, numba_vnni.encoded_bytes(vnni, up.cols)), np.uint8) if vnni >= 0 else ggml_encoded
    given = gate_pre is not None
    gate_out = np.ascontiguousarray(gate_pre, dtype=np.float32) if given else np.zeros((n_tokens, n), np.float32)
    up_out = np.zeros((n_tokens, n), dtype=np.float32)
    use_threads(kernels.get_threads())
    up_rows = kernels.weight_bytes(up)
    _selected_dots((routine.from_float, routine.vec_dot, vnni), up_rows if given else kernels.weight_bytes(gate),
                   up_rows, rows, *grouped, x, ggml_encoded, x_encoded, gate_out, up_out, given)
    return gate_out, up_out


prepare_cache(globals())  # stale machine code flushed, the rest loaded without the compiler (kernels.numba_cache)
