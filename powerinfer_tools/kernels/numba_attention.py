"""A block of tokens' causal attention (a prompt's), compiled: ``layers.attention``'s result without NumPy's passes.

NumPy computes a prompt's attention as two batched BLAS products around a softmax of eight array passes over the
whole square of scores, half of which the causal mask then throws away; the passes, single-threaded, took as long
as the products, and the whole took longer inside a prompt than alone (docs/lab/kernels.md, "A prompt's
attention"). Here each of the kernels' threads takes tiles of ``QUERIES`` consecutive tokens of one
head, which share their keys and values, and for each tile:

* scores ``KEYS`` keys at a time, over the keys the tile's tokens see (not the square): keys are transposed once
  per call (``[kv_heads, head_dim, positions]``), so each step of the sum over ``head_dim`` is one vector load of
  ``KEYS`` keys' values, multiplied into every query's ``KEYS`` sums held in registers (``_sums_of_rows``);
* takes each token's softmax over the keys it sees (its scores soft-capped first where the model caps them:
  Gemma 2), with a vector exp (``_exp_in_place``) instead of libm's;
* adds the values up the same way, ``head_dim`` wide, each value row loaded once for the tile's tokens.

One query over a cache, a head at a time (``one_head``), is what a decoded token attends (``runtime.compiled_decode``)
and, for each of its sequences, a batch's step: ``one_query_each`` takes them all in one call, each thread a share
of the (sequence, head) pairs, with the same vector exp (NumPy's attention, called per sequence, spent most of its
time on a dozen small array operations per call).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from powerinfer_tools.formats import soft_cap
from powerinfer_tools.kernels.numba_cache import prepare_cache
from powerinfer_tools.kernels.numba_kernels import FAST_FLOATS, lane_sum, load, splat, store

QUERIES = 4  # a tile's tokens: QUERIES x (KEYS / 16) float32 sums in AVX-512's 32 registers (the tuples of
# addresses below are spelled out for four)
KEYS = 64  # keys scored at once
VALUE_LANES = (64, 16)  # the widths of a head's output summed at once: the first that divides head_dim
EXP_LANES = 16
# Below this an exp gives 0 (e^-87 is float32's smallest normal): a score this far under its row's largest weighs
# nothing, and a masked one (-inf) exactly nothing.
EXP_FLOOR = -87.0
_F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
# A score's soft-cap as NumPy computes it (``formats/soft_cap.py``), compiled for one value; a cap of 0 is none.
_soft_capped = njit(inline="always")(soft_cap.soft_capped)


def _sums_of_rows(lanes: int):
    @intrinsic
    def sums_of_rows(typingctx, xs, n, rows, row_stride, outs):
        """``outs[r][0:lanes] = Σ_{i<n} xs[r][i] · rows[i]``, float32, for a tuple of addresses ``xs`` (each of n
        consecutive scalars) and ``outs``; row i's ``lanes`` floats at ``rows + i·row_stride`` (bytes), loaded once
        for all of ``xs``."""
        count = xs.count
        sig = types.void(types.UniTuple(types.intp, count), types.intp, types.intp, types.intp,
                         types.UniTuple(types.intp, count))

        def codegen(context, builder, signature, args):
            xs_, n_, rows_, row_stride_, outs_ = args
            lane_type = ir.VectorType(_F32, lanes)
            totals = [cgutils.alloca_once_value(builder, ir.Constant(lane_type, [0.0] * lanes)) for _ in range(count)]
            with cgutils.for_range(builder, n_) as loop:
                row = load(builder, builder.add(rows_, builder.mul(loop.index, row_stride_)), lane_type)
                for r, total in enumerate(totals):
                    x = load(builder, builder.add(builder.extract_value(xs_, r),
                                                  builder.mul(loop.index, ir.Constant(_I64, 4))), _F32)
                    product = builder.fmul(splat(builder, x, lanes), row, flags=("fast",))
                    builder.store(builder.fadd(builder.load(total), product, flags=("fast",)), total)
            for r, total in enumerate(totals):
                store(builder, builder.load(total), builder.extract_value(outs_, r))
            return context.get_dummy_value()

        return sig, codegen

    return sums_of_rows


_score_keys = _sums_of_rows(KEYS)
_add_values_wide, _add_values_narrow = (_sums_of_rows(lanes) for lanes in VALUE_LANES)


@intrinsic
def _exp_in_place(typingctx, addr, n_blocks, shift):
    """``x = exp(x - shift)`` for the ``n_blocks · EXP_LANES`` floats at ``addr`` (0 below ``EXP_FLOOR``); returns
    their sum. Cephes' expf: ``2^k · p(r)``, k the nearest integer to x·log2(e), r = x - k·ln 2 in two parts,
    p of degree 7 (relative error ~1e-7)."""
    sig = types.float32(types.intp, types.intp, types.float32)

    def codegen(context, builder, signature, args):
        addr_, n_blocks_, shift_ = args
        lanes = ir.VectorType(_F32, EXP_LANES)
        ints = ir.VectorType(_I32, EXP_LANES)

        def c(value, of=lanes):
            return ir.Constant(of, [value] * EXP_LANES)

        rint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(lanes, [lanes]),
                                              f"llvm.rint.v{EXP_LANES}f32")
        total = cgutils.alloca_once_value(builder, c(0.0))
        with cgutils.for_range(builder, n_blocks_) as loop:
            at = builder.add(addr_, builder.mul(loop.index, ir.Constant(_I64, 4 * EXP_LANES)))
            x = builder.fsub(load(builder, at, lanes), splat(builder, shift_, EXP_LANES))
            under = builder.fcmp_ordered("<", x, c(EXP_FLOOR))
            x = builder.select(under, c(EXP_FLOOR), x)
            k = builder.call(rint, [builder.fmul(x, c(1.44269504088896341))])
            r = builder.fsub(builder.fsub(x, builder.fmul(k, c(0.693359375))), builder.fmul(k, c(-2.12194440e-4)))
            p = c(1.9875691500e-4)
            for coefficient in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
                p = builder.fadd(builder.fmul(p, r), c(coefficient))
            p = builder.fadd(builder.fadd(builder.fmul(builder.fmul(p, r), r), r), c(1.0))
            two_to_k = builder.bitcast(builder.shl(builder.add(builder.fptosi(k, ints), c(127, ints)), c(23, ints)),
                                       lanes)
            e = builder.select(under, c(0.0), builder.fmul(p, two_to_k))
            store(builder, e, at)
            builder.store(builder.fadd(builder.load(total), e), total)
        return lane_sum(builder, builder.load(total))

    return sig, codegen


def takes(head_dim: int) -> bool:
    """Whether ``causal_attention`` takes heads of ``head_dim``: its values are summed 16 or 64 floats at once."""
    return any(head_dim % lanes == 0 for lanes in VALUE_LANES)


def scratch(n_tokens: int, n_heads: int, n_keys: int, n_kv: int, head_dim: int, threads: int) -> tuple:
    """``causal_attention``'s scratch arrays, allocated by the caller (the C heap's memory, kept between layers:
    ``runtime.host_memory``). Score rows have room for a block starting at any multiple of 16 below the last key
    and running ``KEYS`` on."""
    width = (n_keys + 15) // 16 * 16 + KEYS
    return (np.empty((n_kv, head_dim, width), np.float32),
            np.empty((n_heads, n_tokens + QUERIES, head_dim), np.float32),
            np.empty((threads, QUERIES, width), np.float32), np.empty((threads, QUERIES, head_dim), np.float32))


@njit(parallel=True, nogil=True, cache=True, **FAST_FLOATS)
def causal_attention(q, keys, values, start, window, scale, softcap, keys_t, queries, scores, sums, out):
    """``out [T, heads·hd]``: attention of ``q [T, heads, hd]`` at positions ``start ..`` over ``keys, values
    [S, kv_heads, hd]`` (C-contiguous, S = start + T), each query seeing the positions up to its own and, where
    ``window`` > 0, above its own less ``window``; scores times ``scale``, soft-capped where ``softcap`` > 0.
    Scratch, float32 (``scratch``): ``keys_t [kv_heads, hd, width]``, ``queries [heads, T + QUERIES, hd]``, and each
    thread's ``scores [threads, QUERIES, width]`` and ``sums [threads, QUERIES, hd]``, ``width`` as ``scratch`` gives
    it."""
    n_tokens, n_heads, head_dim = q.shape
    n_keys, n_kv = keys.shape[0], keys.shape[1]
    group = n_heads // n_kv
    width, n_threads = keys_t.shape[2], scores.shape[0]
    for kv in prange(n_kv):
        keys_t[kv, :, n_keys:] = 0.0
        for s in range(n_keys):
            for d in range(head_dim):
                keys_t[kv, d, s] = keys[s, kv, d]
    for h in prange(n_heads):  # each head's queries token after token, scaled; spare rows for a short last tile
        queries[h, n_tokens:] = 0.0
        for t in range(n_tokens):
            for d in range(head_dim):
                queries[h, t, d] = q[t, h, d] * scale
    row_bytes, value_stride = 4 * width, 4 * n_kv * head_dim
    value_lanes = VALUE_LANES[0] if head_dim % VALUE_LANES[0] == 0 else VALUE_LANES[1]
    tiles = (n_tokens + QUERIES - 1) // QUERIES
    for thread in prange(n_threads):
        s_at, o_at = scores[thread].ctypes.data, sums[thread].ctypes.data
        score_rows = (s_at, s_at + row_bytes, s_at + 2 * row_bytes, s_at + 3 * row_bytes)
        sum_rows = (o_at, o_at + 4 * head_dim, o_at + 8 * head_dim, o_at + 12 * head_dim)
        for i in range(thread, n_heads * tiles, n_threads):  # dealt round: early (short) and late tiles alike
            h, first = i // tiles, (i % tiles) * QUERIES
            _tile(queries[h, first].ctypes.data, keys_t[h // group], values[:, h // group], start, window, softcap,
                  first, min(first + QUERIES, n_tokens) - 1, scores[thread], score_rows, sum_rows, row_bytes,
                  value_stride, value_lanes)
            for r in range(min(QUERIES, n_tokens - first)):
                out[first + r, h * head_dim : (h + 1) * head_dim] = sums[thread, r]


@njit(inline="always", **FAST_FLOATS)
def _tile(q_at, keys_t, values, start, window, softcap, first, last, scores, score_rows, sum_rows, row_bytes,
          value_stride, value_lanes):
    """The attention of one head's tokens ``first .. last`` (queries at ``q_at``, one after another) into
    ``sum_rows``, through ``scores``."""
    head_dim = keys_t.shape[0]
    seen_end = start + last + 1  # past the last key any token of the tile sees
    seen_from = 0 if window <= 0 else max(0, start + first - window + 1)
    block_from, block_end = seen_from // 16 * 16, (seen_end + 15) // 16 * 16
    query_rows = (q_at, q_at + 4 * head_dim, q_at + 8 * head_dim, q_at + 12 * head_dim)
    for key in range(block_from, seen_end, KEYS):
        _score_keys(query_rows, head_dim, keys_t.ctypes.data + 4 * key, row_bytes,
                    (score_rows[0] + 4 * key, score_rows[1] + 4 * key, score_rows[2] + 4 * key,
                     score_rows[3] + 4 * key))
    for r in range(QUERIES):
        position = start + min(first + r, last)  # a short tile's spare rows repeat its last token
        sees_from = 0 if window <= 0 else max(0, position - window + 1)
        row = scores[r]
        if softcap > 0:
            for s in range(sees_from, position + 1):
                row[s] = _soft_capped(row[s], softcap)
        top = np.float32(-np.inf)
        for s in range(sees_from, position + 1):
            top = max(top, row[s])
        row[block_from:sees_from] = -np.inf
        row[position + 1 : block_end] = -np.inf
        norm = np.float32(1.0) / _exp_in_place(row.ctypes.data + 4 * block_from,
                                               (block_end - block_from) // EXP_LANES, top)
        row[block_from:block_end] *= norm
    weights = (score_rows[0] + 4 * block_from, score_rows[1] + 4 * block_from, score_rows[2] + 4 * block_from,
               score_rows[3] + 4 * block_from)
    for d in range(0, head_dim, value_lanes):
        outs = (sum_rows[0] + 4 * d, sum_rows[1] + 4 * d, sum_rows[2] + 4 * d, sum_rows[3] + 4 * d)
        rows = values[block_from].ctypes.data + 4 * d
        if value_lanes == VALUE_LANES[0]:
            _add_values_wide(weights, seen_end - block_from, rows, value_stride, outs)
        else:
            _add_values_narrow(weights, seen_end - block_from, rows, value_stride, outs)


@intrinsic
def _floats_at(typingctx, addr):
    """The float32 pointer at the integer address ``addr`` (for ``carray``)."""
    sig = types.CPointer(types.float32)(types.intp)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], _F32.as_pointer())

    return sig, codegen


@njit(inline="always")
def score_width(longest: int) -> int:
    """The length of a score row ``one_head`` takes for caches of up to ``longest`` positions: whole blocks of
    ``EXP_LANES`` from any multiple of it below a window's first key."""
    return (longest + EXP_LANES - 1) // EXP_LANES * EXP_LANES


def each_scratch(n_sequences: int, n_heads: int, longest: int) -> np.ndarray:
    """``one_query_each``'s score rows, ``[sequences · heads, score_width(longest)]``."""
    return np.empty((n_sequences * n_heads, score_width(longest)), np.float32)


@njit(parallel=True, nogil=True, cache=True, **FAST_FLOATS)
def one_query_each(q, key_at, value_at, lengths, firsts, n_kv, scale, softcap, scores, out):
    """``out [B, heads·hd]``: attention of each sequence's one query ``q[b] [heads, hd]``, at its last position,
    over its own keys and values: float32 ``[lengths[b], n_kv, hd]`` C-contiguous at the addresses ``key_at[b]``,
    ``value_at[b]``, from position ``firsts[b]`` (a window's first; else 0); scores times ``scale``, soft-capped
    where ``softcap`` > 0. ``scores``: ``each_scratch``'s."""
    n_sequences, n_heads, head_dim = q.shape
    group = n_heads // n_kv
    for i in prange(n_sequences * n_heads):
        b, h = i // n_heads, i % n_heads
        keys = carray(_floats_at(key_at[b]), (lengths[b], n_kv, head_dim))
        values = carray(_floats_at(value_at[b]), (lengths[b], n_kv, head_dim))
        one_head(q[b, h], keys, values, h // group, firsts[b], lengths[b], scale, softcap, scores[i],
                 out[b, h * head_dim : (h + 1) * head_dim])


@njit(inline="always", **FAST_FLOATS)
def one_head(q_h, keys, values, kv, first, n, scale, softcap, row, o):
    """``o [hd]``: one head's query ``q_h`` attending over positions ``first .. n - 1`` of ``keys, values [S, kv_heads,
    hd]``, its KV head ``kv``, scores times ``scale`` and soft-capped where ``softcap`` > 0, through ``row``
    (``score_width(n)`` floats or more): a batch's step (``one_query_each``) and one decoded token
    (``runtime.compiled_decode``)."""
    head_dim = q_h.shape[0]
    block_from, block_end = first // EXP_LANES * EXP_LANES, score_width(n)
    row[block_from:first] = -np.inf
    row[n:block_end] = -np.inf
    top = np.float32(-np.inf)
    for s in range(first, n):
        total = np.float32(0.0)
        for d in range(head_dim):
            total += q_h[d] * keys[s, kv, d]
        row[s] = total * scale
        if softcap > 0:
            row[s] = _soft_capped(row[s], softcap)
        top = max(top, row[s])
    norm = np.float32(1.0) / _exp_in_place(row.ctypes.data + 4 * block_from, (block_end - block_from) // EXP_LANES,
                                           top)
    o[:] = 0.0
    for s in range(first, n):
        weight = row[s] * norm
        for d in range(head_dim):
            o[d] += weight * values[s, kv, d]


prepare_cache(globals())  # stale machine code flushed, the rest loaded without the compiler (kernels.numba_cache)
