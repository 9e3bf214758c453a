"""q4_0 and q8_0 products for one token with AVX-512 VNNI: a sparse FFN's scattered gate and up rows,
an output head, and (below) matrices interleaved eight rows at a time.

Reading the active rows is not what bounds a sparse FFN here: ggml's ``vec_dot_q4_0_q8_0`` (one block of 32
weights per step, 256-bit) computes scattered 1152-byte q4_0 rows more slowly than two threads can read them;
``row_dot`` keeps up with the reads (``examples/bench_kernels.py --only-vnni``; docs/lab/kernels.md).
``row_dot`` takes a row a group of blocks at a time (four q4_0 blocks, 72 bytes; two q8_0 blocks, 68
bytes): two 64-byte loads and one byte permute gather the group's 64 bytes of quants, one word
permute its f16 scales, and ``vpdpbusd`` multiplies the weights, as unsigned bytes, with the input's
int8 values and sums them in 32-bit lanes, 16 / (blocks per group) lanes per block; the lanes are
scaled in float and summed once per row. q4_0 gives two operands per group (low nibbles: values 0-15
of each block; high: 16-31), each weight ``nibble - 8``; q8_0 one (its int8 XOR 0x80: ``byte - 128``).

The input is ggml's own q8_0 encoding of x (what ``vec_dot`` takes), rearranged once per token by
``encode`` into, per group: the x values each operand meets (64 int8 an operand), 16 float32 (block
k's scale in its lanes) and 16 int32 (-zero × the sum of block k's values in its first lane, zeros
elsewhere, zero being 8 or 128: the dot product starts from that offset). With ggml's rounding of x
kept, a row's product is ggml's up to float32 summation order. Needs a CPU with AVX-512
F/BW/VBMI/VNNI (``available``); the runtime uses ggml's ``vec_dot`` elsewhere.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from powerinfer_tools.formats import weight_types
from powerinfer_tools.formats.weight_types import WEIGHT_TYPES, Kernel, implementations
from powerinfer_tools.kernels.numba_kernels import (BLOCK, PREFETCH_ROWS, TO_L1, TO_L2, compiles_for, const,
                                                     ggml_from_float, in_order, lane_sum, load, meet, offset, prefetch,
                                                     refuse_unclaimed, splat, store, switch_on_type, type_mask, vec)
from powerinfer_tools.kernels.numba_cache import prepare_cache

Q8_0_BLOCK_BYTES = WEIGHT_TYPES[weight_types.Q8_0].block_bytes  # f16 scale + 32 int8
_FEATURES = ("avx512f", "avx512bw", "avx512vbmi", "avx512vnni")
_LANES = 16  # int32 / float32 lanes of a 512-bit register

_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_HALF = ir.HalfType()


@dataclass(frozen=True)
class _Rows:
    """How ``row_dot`` reads one weight type: ``blocks`` blocks a group, each ``block_bytes`` long (an
    f16 scale, then ``quant_bytes`` of quants: two weights a byte, as nibbles, where ``nibbles``, else one);
    weights are stored ``zero`` above their value."""

    qtype: GGMLQuantizationType
    nibbles: bool
    blocks: int
    block_bytes: int
    quant_bytes: int
    zero: int

    @property
    def group_bytes(self) -> int:
        return self.blocks * self.block_bytes

    @property
    def group_cols(self) -> int:
        return self.blocks * BLOCK

    @property
    def operands(self) -> int:  # 64-byte operands a group gives: its 64 bytes of quants hold them all
        return self.blocks * BLOCK // 64

    @property
    def encoded_group_bytes(self) -> int:
        return 64 * self.operands + 8 * _LANES  # the x values, then float32 scales and int32 offsets


_Q4_0_ROWS = _Rows(weight_types.Q4_0, True, 4, WEIGHT_TYPES[weight_types.Q4_0].block_bytes, 16, 8)
_Q8_0_ROWS = _Rows(weight_types.Q8_0, False, 2, Q8_0_BLOCK_BYTES, 32, 128)
# The row formats by type: what ``encode`` and ``row_dot`` take (the compiled decoder's gate/up rows: q4_0's)
_FORMATS = {rows.qtype: rows for rows in (_Q4_0_ROWS, _Q8_0_ROWS)}
_FORMAT_TYPES = type_mask(_FORMATS)
# The types ``dot_rows`` takes (``usable``): those whose rows claim the VNNI row dot
_ROWS = implementations(Kernel.VNNI_ROW_DOT, _FORMATS, __name__)
_ROW_DOT_TYPES = type_mask(_ROWS)
GROUP_COLS = _Q4_0_ROWS.group_cols  # the compiled decoder's gate/up rows: q4_0 (``GATE_UP_TYPES``)


@functools.cache
def available() -> bool:
    """Whether numba compiles for a CPU with the instructions ``row_dot`` uses: the host's features,
    or those NUMBA_CPU_FEATURES lists (NUMBA_CPU_NAME naming another CPU without them: no)."""
    return compiles_for(_FEATURES)


def usable(qtype: int, cols: int) -> bool:
    """Whether rows of ``cols`` weights of ggml type ``qtype`` can take ``dot_rows`` here: a type that claims
    ``Kernel.VNNI_ROW_DOT`` (q4_0, q8_0), in whole groups, on a CPU with the instructions."""
    return qtype in _ROWS and cols % _ROWS[qtype].group_cols == 0 and available()


def encoded_bytes(qtype: int, cols: int) -> int:
    rows = _FORMATS[qtype]
    return cols // rows.group_cols * rows.encoded_group_bytes


def _vpdpbusd(builder, acc, unsigned_bytes, signed_bytes):
    """``acc`` (16 int32) plus, per lane, the sum of four products of unsigned and signed bytes. The
    intrinsic is declared with int32 operands, the form LLVM before 21 takes and newer ones upgrade.
    For a CPU without it the same sum is spelled in plain vector IR: the functions that hold these
    kernels are compiled everywhere (the choice between them and ggml's is made at run time), and
    LLVM cannot compile the intrinsic for a CPU that lacks it."""
    i32x16 = vec(_I32, _LANES)
    if not available():
        products = builder.mul(builder.zext(unsigned_bytes, vec(_I32, 64)), builder.sext(signed_bytes, vec(_I32, 64)))
        for k in range(4):
            acc = builder.add(acc, builder.shuffle_vector(products, products, const(_I32, _LANES, range(k, 64, 4))))
        return acc
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32x16, [i32x16] * 3),
                                        "llvm.x86.avx512.vpdpbusd.512")
    return builder.call(fn, [acc, builder.bitcast(unsigned_bytes, i32x16), builder.bitcast(signed_bytes, i32x16)])


def _weight_operands(builder, fmt: _Rows, quants):
    """The group's weights as unsigned bytes, one 64-byte operand each (see the module doc)."""
    if fmt.nibbles:
        return [builder.and_(quants, const(_I8, 64, [0x0F] * 64)), builder.lshr(quants, const(_I8, 64, [4] * 64))]
    return [builder.xor(quants, const(_I8, 64, [0x80] * 64))]


def _group_products(builder, fmt: _Rows, row_group, x_groups):
    """Per input of ``x_groups`` (the same group of each), 16 float lanes whose sum is the group's share of its dot
    product (see the module doc): the group's weights and scales are loaded and unpacked once for all of them."""
    first = load(builder, row_group, vec(_I8, 64))
    tail = fmt.group_bytes - 64  # the second load ends where the group ends
    second = load(builder, offset(builder, row_group, tail), vec(_I8, 64))
    where = [fmt.block_bytes * k + 2 + j for k in range(fmt.blocks) for j in range(fmt.quant_bytes)]
    quants = builder.shuffle_vector(first, second, const(_I32, 64, [p if p < 64 else 64 + p - tail for p in where]))
    weights = _weight_operands(builder, fmt, quants)
    lanes = _LANES // fmt.blocks
    words = builder.bitcast(first, vec(_I16, 32))  # block k's scale is word block_bytes * k / 2
    scales = builder.shuffle_vector(words, words, const(_I32, _LANES, [fmt.block_bytes // 2 * (lane // lanes)
                                                                        for lane in range(_LANES)]))
    scales = builder.fpext(builder.bitcast(scales, vec(_HALF, _LANES)), vec(_F32, _LANES))
    operands, products = 64 * fmt.operands, []
    for x_group in x_groups:
        sums = load(builder, offset(builder, x_group, operands + 4 * _LANES), vec(_I32, _LANES))  # the offsets
        for i, w in enumerate(weights):
            sums = _vpdpbusd(builder, sums, w, load(builder, offset(builder, x_group, 64 * i), vec(_I8, 64)))
        x_scales = builder.fmul(scales, load(builder, offset(builder, x_group, operands), vec(_F32, _LANES)))
        products.append(builder.fmul(builder.sitofp(sums, vec(_F32, _LANES)), x_scales, flags=("contract",)))
    return products


def _row_dot(fmt: _Rows, locality: int):
    """``row_dot`` for rows of ``fmt``, its prefetch hints into the level ``locality`` (``numba_kernels.TO_L1``
    for rows read in order, ``TO_L2`` for scattered ones)."""

    @intrinsic
    def row_dot(typingctx, row, x, n_groups, ahead):
        sig = types.float32(types.intp, types.intp, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            return _emit_row_dot(builder, fmt, locality, *args)

        return sig, codegen

    return row_dot


def _emit_row_dot(builder, fmt: _Rows, locality: int, row, x, n_groups, ahead):
    """``row_dot``'s code: the float32 dot product of the row at address ``row`` with x (see below)."""
    return _emit_row_dots(builder, fmt, locality, row, [x], n_groups, ahead)[0]


def _emit_row_dots(builder, fmt: _Rows, locality: int, row, xs, n_groups, ahead):
    """The float32 dot products of the row at address ``row`` with each input at the addresses ``xs``, each group
    of the row loaded once for all of them."""
    totals = [cgutils.alloca_once_value(builder, ir.Constant(vec(_F32, _LANES), [0.0] * _LANES)) for _ in xs]
    with cgutils.for_range(builder, n_groups) as loop:
        at = builder.mul(loop.index, ir.Constant(_I64, fmt.group_bytes))
        for last_byte in (0, fmt.group_bytes - 1):  # a group spans two cache lines at most
            prefetch(builder, builder.add(ahead, builder.add(at, ir.Constant(_I64, last_byte))), locality)
        x_at = builder.mul(loop.index, ir.Constant(_I64, fmt.encoded_group_bytes))
        products = _group_products(builder, fmt, builder.add(row, at), [builder.add(x, x_at) for x in xs])
        for total, product in zip(totals, products):
            builder.store(builder.fadd(builder.load(total), product, flags=("contract",)), total)
    return [lane_sum(builder, builder.load(total)) for total in totals]


# The dot product of the row at address ``row`` (``n_groups`` groups) with the input ``encode`` wrote at address
# ``x``, as a float32. Each group also asks the cache for the same group of the row at ``ahead`` (the next-but-one
# the caller reads; ``row`` itself when none): spread over the work like this, the requests kept scattered q4_0 rows
# coming faster than the whole row's lines asked for up front (``numba_kernels.prefetch_span``; a one-off comparison
# while writing it, two threads), whose burst of 18 requests fills the core's line fill buffers and stalls the loads
# behind.
row_dot_q4_0, _in_order_q4_0 = _row_dot(_Q4_0_ROWS, TO_L2), _row_dot(_Q4_0_ROWS, TO_L1)  # scattered rows, in order


@intrinsic
def row_dot(typingctx, qtype, row, x, cols, ahead, order):
    """The ``row_dot`` of ``qtype``'s format (a type of ``_FORMATS``) for a row of ``cols`` weights, among rows read
    in order or not (``order``: ``numba_kernels.in_order``)."""
    sig = types.float32(types.intp, types.intp, types.intp, types.intp, types.intp, types.boolean)

    def codegen(context, builder, signature, args):
        qtype_, row_, x_, cols_, ahead_, order_ = args
        return _emit_typed_row_dots(builder, qtype_, row_, [x_], cols_, ahead_, order_)[0]

    return sig, codegen


TOKENS_AT_ONCE = 4  # the inputs ``row_dots`` takes at once (a batch's step of four sequences in one call)


@intrinsic
def row_dots(typingctx, qtype, row, xs, cols, ahead, order):
    """``row_dot`` of one row with each of the inputs at the addresses ``xs`` (a tuple), the row's groups loaded and
    unpacked once for all of them: a tuple of their dot products."""
    count = xs.count
    sig = types.UniTuple(types.float32, count)(types.intp, types.intp, types.UniTuple(types.intp, count), types.intp,
                                               types.intp, types.boolean)

    def codegen(context, builder, signature, args):
        qtype_, row_, xs_, cols_, ahead_, order_ = args
        xs_values = [builder.extract_value(xs_, i) for i in range(count)]
        dots = _emit_typed_row_dots(builder, qtype_, row_, xs_values, cols_, ahead_, order_)
        return context.make_tuple(builder, signature.return_type, dots)

    return sig, codegen


def _emit_typed_row_dots(builder, qtype_, row_, xs, cols_, ahead_, order_):
    """``_emit_row_dots`` for ``qtype_``'s format (switched on at run time) and the order the rows are read in."""

    def dots(fmt):
        n_groups = builder.udiv(cols_, ir.Constant(cols_.type, fmt.group_cols))
        branch_dots = []
        with builder.if_else(order_) as branches:
            for branch, locality in zip(branches, (TO_L1, TO_L2)):  # rows in order, scattered rows
                with branch:
                    branch_dots.append((_emit_row_dots(builder, fmt, locality, row_, xs, n_groups, ahead_),
                                        builder.block))
        return [meet(builder, [(values[i], block) for values, block in branch_dots]) for i in range(len(xs))]

    return switch_on_type(builder, qtype_, {t: functools.partial(dots, fmt) for t, fmt in _FORMATS.items()})


def _emit_encode_group(builder, fmt: _Rows, blocks, out):
    """Rearrange a group's q8_0 blocks of x at address ``blocks`` into one encoded group for ``fmt`` at ``out``."""
    lanes, operands = _LANES // fmt.blocks, 64 * fmt.operands
    for k in range(fmt.blocks):
        block = offset(builder, blocks, k * Q8_0_BLOCK_BYTES)
        values = load(builder, offset(builder, block, 2), vec(_I8, BLOCK))
        for o in range(fmt.operands):  # operand o meets values o*q .. of each block, q = quant bytes
            q = fmt.quant_bytes
            part = builder.shuffle_vector(values, values, const(_I32, q, range(o * q, o * q + q)))
            store(builder, part, offset(builder, out, 64 * o + q * k))
        scale = builder.fpext(load(builder, block, _HALF), _F32)
        total = _lane_sum_int(builder, builder.sext(values, vec(_I32, BLOCK)))
        start = builder.mul(total, ir.Constant(_I32, -fmt.zero))
        for lane in range(lanes):
            at = 4 * (lanes * k + lane)
            store(builder, scale, offset(builder, out, operands + at))
            store(builder, start if lane == 0 else ir.Constant(_I32, 0),
                  offset(builder, out, operands + 4 * _LANES + at))


@intrinsic
def _encode_groups(typingctx, qtype, x_q8_0, out, cols):
    """``encode``'s work for ``qtype``'s format (a type of ``_FORMATS``): every group of ``cols`` values of x."""
    sig = types.void(*[types.intp] * 4)

    def codegen(context, builder, signature, args):
        qtype_, x_, out_, cols_ = args

        def encode(fmt):
            x_bytes = ir.Constant(_I64, fmt.group_cols // BLOCK * Q8_0_BLOCK_BYTES)  # a group's q8_0 blocks of x
            out_bytes = ir.Constant(_I64, fmt.encoded_group_bytes)
            with cgutils.for_range(builder, builder.udiv(cols_, ir.Constant(cols_.type, fmt.group_cols))) as loop:
                _emit_encode_group(builder, fmt, builder.add(x_, builder.mul(loop.index, x_bytes)),
                                   builder.add(out_, builder.mul(loop.index, out_bytes)))

        switch_on_type(builder, qtype_, {t: functools.partial(encode, fmt) for t, fmt in _FORMATS.items()})
        return context.get_dummy_value()

    return sig, codegen


def _lane_sum_int(builder, lanes):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [lanes.type]),
                                        "llvm.vector.reduce.add.v32i32")
    return builder.call(fn, [lanes])


@njit(nogil=True, cache=True)
def encode(qtype, x_q8_0, out, cols):
    """ggml's q8_0 encoding of an input of ``cols`` values (bytes) rearranged for ``qtype`` rows into ``out``."""
    refuse_unclaimed(_FORMAT_TYPES, qtype)
    _encode_groups(qtype, x_q8_0.ctypes.data, out.ctypes.data, cols)


@njit(nogil=True, cache=True)
def encode_tokens(qtype, from_float, x, x_q8_0, x_encoded):
    """Each token's row of ``x [T, cols]`` as ``row_dot`` takes it: ggml's q8_0 encoding (``from_float``) into its
    row of the scratch ``x_q8_0``, then ``encode``'s into its row of ``x_encoded``."""
    for t in range(x.shape[0]):
        ggml_from_float(from_float, x[t].ctypes.data, x_q8_0[t].ctypes.data, x.shape[1])
        encode(qtype, x_q8_0[t], x_encoded[t], x.shape[1])


@njit(inline="always")
def row_dot_q4_0_rows(row, x, n_groups, ahead, order):
    """``row_dot_q4_0`` for a row among rows read in order (``order``: ``numba_kernels.in_order``) or not."""
    if order:
        return _in_order_q4_0(row, x, n_groups, ahead)
    return row_dot_q4_0(row, x, n_groups, ahead)


# The types of the compiled decoder's gate/up rows that take ``row_dot_q4_0_rows`` (``ffn_decode.rows_take_vnni``)
GATE_UP_TYPES = type_mask(implementations(Kernel.VNNI_GATE_UP, {weight_types.Q4_0: row_dot_q4_0_rows}, __name__))


@njit(parallel=True, nogil=True, cache=True)
def dot_rows(qtype, from_float, weights, rows, x, x_q8_0, x_encoded, out):
    """``out[t, i] = weights[rows[i]] · x[t]`` for each token t (q4_0 or q8_0 rows, ``usable``; x float32
    ``[T, cols]``, each token encoded into its row of the scratch ``x_q8_0`` and ``x_encoded``), the threads
    sharing the rows: each row is read from memory once for all the tokens, and unpacked once for four at a time
    (``row_dots``)."""
    refuse_unclaimed(_ROW_DOT_TYPES, qtype)
    n_tokens, cols = x.shape
    n = rows.shape[0]
    encode_tokens(qtype, from_float, x, x_q8_0, x_encoded)
    w, row_bytes = weights.ctypes.data, weights.strides[0]
    x_addr, x_stride = x_encoded.ctypes.data, x_encoded.strides[0]
    order = in_order(rows)
    if n_tokens < TOKENS_AT_ONCE:  # (a loop of its own: one token's, an output head's, runs faster so)
        for i in prange(n):
            row, ahead = w + rows[i] * row_bytes, w + rows[min(i + PREFETCH_ROWS, n - 1)] * row_bytes
            for t in range(n_tokens):
                out[t, i] = row_dot(qtype, row, x_addr + t * x_stride, cols, ahead, order)
        return
    in_fours = n_tokens - n_tokens % TOKENS_AT_ONCE
    for i in prange(n):
        row, ahead = w + rows[i] * row_bytes, w + rows[min(i + PREFETCH_ROWS, n - 1)] * row_bytes
        for t in range(0, in_fours, TOKENS_AT_ONCE):  # (TOKENS_AT_ONCE spelled out: four)
            x = x_addr + t * x_stride
            out[t, i], out[t + 1, i], out[t + 2, i], out[t + 3, i] = row_dots(
                qtype, row, (x, x + x_stride, x + 2 * x_stride, x + 3 * x_stride), cols, ahead, order)
        for t in range(in_fours, n_tokens):
            out[t, i] = row_dot(qtype, row, x_addr + t * x_stride, cols, ahead, order)


# --- whole matrices interleaved eight rows at a time (kernels.interleaved, ggml's block_q4_0x8) ----------
#
# ggml's own gemv for that layout (AVX2) computes q/k/v/o more slowly than memory delivers them; with VNNI a block
# of eight rows is two 64-byte loads of nibbles and four ``vpdpbusd``: the 16 int32 lanes hold row r's
# sums in lanes 2r and 2r + 1, each over 8 of the block's 32 values. Piece i of the quants is row i % 8's
# bytes 8 * (i // 8) ..: the first 64 bytes hold each row's values 0-7 (low nibbles) and 16-23 (high),
# the second 8-15 and 24-31, so each meets one 8-byte run of x repeated across the rows. The x operand
# is ggml's q8_0 encoding as it is, plus two floats per block from ``block_sums``.

_INTERLEAVED_ROWS = 8
# Each block asks the cache for the bytes 16 blocks on: the hardware prefetcher alone trails (a one-off
# comparison while writing it, 2048 x 2048 from memory, 2 threads; 4 or 8 blocks on did no better).
_AHEAD_BYTES = 2304
_INTERLEAVED_BLOCK_BYTES = _INTERLEAVED_ROWS * WEIGHT_TYPES[weight_types.Q4_0].block_bytes


def _splat_bytes(builder, addr):
    """The 8 bytes at ``addr`` repeated eight times, as 64 int8."""
    one = load(builder, addr, _I64)
    lanes = builder.insert_element(ir.Constant(vec(_I64, 8), ir.Undefined), one, ir.Constant(_I32, 0))
    lanes = builder.shuffle_vector(lanes, lanes, const(_I32, 8, [0] * 8))
    return builder.bitcast(lanes, vec(_I8, 64))


def _interleaved_block(builder, block, x_block, sums):
    """16 float lanes whose pairs (2r, 2r + 1) sum to row r's share of one 32-column block."""
    nibbles = []
    for half in range(2):  # ggml stores each nibble XOR 8, a signed 4-bit value: undo it
        quants = load(builder, offset(builder, block, 16 + 64 * half), vec(_I8, 64))
        for shift in (0, 4):
            part = builder.lshr(quants, const(_I8, 64, [shift] * 64)) if shift else quants
            nibbles.append(builder.xor(builder.and_(part, const(_I8, 64, [0x0F] * 64)), const(_I8, 64, [8] * 64)))
    low_first, high_first, low_second, high_second = nibbles  # values 0-7, 16-23, 8-15, 24-31 of each row
    acc = ir.Constant(vec(_I32, 16), [0] * 16)
    for values, first_value in ((low_first, 0), (low_second, 8), (high_first, 16), (high_second, 24)):
        acc = _vpdpbusd(builder, acc, values, _splat_bytes(builder, offset(builder, x_block, 2 + first_value)))
    halves = load(builder, block, vec(_HALF, _INTERLEAVED_ROWS))
    scales = builder.fpext(builder.shuffle_vector(halves, halves, const(_I32, 16, [lane // 2 for lane in range(16)])),
                           vec(_F32, 16))
    x_scale, x_offset = (splat(builder, load(builder, offset(builder, sums, 4 * k), _F32), _LANES) for k in range(2))
    product = builder.fmul(builder.sitofp(acc, vec(_F32, 16)), builder.fmul(scales, x_scale), flags=("contract",))
    return builder.fadd(product, builder.fmul(scales, x_offset, flags=("contract",)), flags=("contract",))


@intrinsic
def interleaved_group(typingctx, group, x_q8_0, sums, n_blocks, out):
    """The eight products of one interleaved group of eight rows (``n_blocks`` blocks of 144 bytes at
    address ``group``) with x (ggml's q8_0 at ``x_q8_0``, ``block_sums`` at ``sums``), as eight floats
    stored at address ``out``."""
    sig = types.void(types.intp, types.intp, types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        group_, x_, sums_, n_blocks_, out_ = args
        total = cgutils.alloca_once_value(builder, ir.Constant(vec(_F32, 16), [0.0] * 16))
        with cgutils.for_range(builder, n_blocks_) as loop:
            b = loop.index
            here = builder.add(group_, builder.mul(b, ir.Constant(_I64, _INTERLEAVED_BLOCK_BYTES)))
            for last_byte in (0, _INTERLEAVED_BLOCK_BYTES - 1):
                prefetch(builder, builder.add(here, ir.Constant(_I64, _AHEAD_BYTES + last_byte)))
            part = _interleaved_block(builder, here,
                                      builder.add(x_, builder.mul(b, ir.Constant(_I64, Q8_0_BLOCK_BYTES))),
                                      builder.add(sums_, builder.mul(b, ir.Constant(_I64, 8))))
            builder.store(builder.fadd(builder.load(total), part, flags=("contract",)), total)
        lanes = builder.load(total)
        rows = builder.fadd(builder.shuffle_vector(lanes, lanes, const(_I32, 8, range(0, 16, 2))),
                            builder.shuffle_vector(lanes, lanes, const(_I32, 8, range(1, 16, 2))))
        store(builder, rows, out_)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _block_sums(typingctx, block, out):
    """For the q8_0 block at ``block``: its scale d and -4 d × the sum of its values, two floats at ``out``
    (each of a row's two lanes adds half of the -8 d × sum that q4_0's offset contributes)."""
    sig = types.void(types.intp, types.intp)

    def codegen(context, builder, signature, args):
        block_, out_ = args
        d = builder.fpext(load(builder, block_, _HALF), _F32)
        total = _lane_sum_int(builder, builder.sext(load(builder, offset(builder, block_, 2), vec(_I8, BLOCK)),
                                                   vec(_I32, BLOCK)))
        store(builder, d, out_)
        store(builder, builder.fmul(builder.fmul(d, ir.Constant(_F32, -4.0)), builder.sitofp(total, _F32)),
              offset(builder, out_, 4))
        return context.get_dummy_value()

    return sig, codegen


@njit(nogil=True, cache=True)
def block_sums(x_q8_0, n_blocks):
    """What ``interleaved_group`` takes beside x's q8_0 encoding: two float32 per block."""
    out = np.empty(2 * n_blocks, np.float32)
    for b in range(n_blocks):
        _block_sums(x_q8_0.ctypes.data + b * Q8_0_BLOCK_BYTES, out.ctypes.data + 8 * b)
    return out


prepare_cache(globals())  # stale machine code flushed, the rest loaded without the compiler (kernels.numba_cache)
