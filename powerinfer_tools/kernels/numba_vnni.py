"""q4_0 row products for one token with AVX-512 VNNI, for the sparse FFN's scattered gate and up rows.

Reading the active rows is not what bounds a sparse FFN here: a 2-core VM reads scattered 1152-byte
rows at 15-21 GB/s, but ggml's ``vec_dot_q4_0_q8_0`` (one block of 32 weights per step, 256-bit)
computes 7 GB/s on one core even from L1, and a matrix of them from memory at ~5 GB/s on two
(``examples/bench_kernels.py --only-vnni``). ``row_dot`` takes a row four blocks (72 bytes) at a time:
two 64-byte loads and one byte permute gather the four blocks' 64 bytes of nibbles, one word permute
their four f16 scales, and two ``vpdpbusd`` multiply the nibbles (unsigned) with the input's int8
values (signed) and sum them in 32-bit lanes, four lanes per block; the lanes are scaled in float and
summed once per row.

The input is ggml's own q8_0 encoding of x (what ``vec_dot`` takes), rearranged once per token by
``encode`` into 256 bytes per group of four blocks:

* 64 int8: elements 0-15 of each block (the values the low nibbles multiply), block after block;
* 64 int8: elements 16-31 of each (the high nibbles');
* 16 float32: block k's scale in lanes 4k..4k+3;
* 16 int32: -8 × the sum of block k's values in lane 4k, zeros elsewhere: q4_0 weights are
  ``scale × (nibble - 8)``, so the dot product starts from that offset.

With ggml's rounding of x kept, a row's product is ggml's up to float32 summation order. Needs a
CPU with AVX-512 F/BW/VBMI/VNNI (``available``); the runtime uses ggml's ``vec_dot`` elsewhere.
"""

from __future__ import annotations

import llvmlite.binding
import numpy as np
import numba
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from powerinfer_tools.kernels.numba_kernels import BLOCK, prefetch

GROUP_BLOCKS = 4  # q4_0 blocks a step of row_dot takes
GROUP_COLS = GROUP_BLOCKS * BLOCK
Q4_0_GROUP_BYTES = GROUP_BLOCKS * GGML_QUANT_SIZES[GGMLQuantizationType.Q4_0][1]  # f16 scale + 16 bytes each
Q8_0_BLOCK_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0][1]  # f16 scale + 32 int8
ENCODED_GROUP_BYTES = 256  # see the module doc
_FEATURES = ("avx512f", "avx512bw", "avx512vbmi", "avx512vnni")

_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_HALF = ir.HalfType()


def available() -> bool:
    """Whether numba compiles for a CPU with the instructions ``row_dot`` uses (the host, unless
    NUMBA_CPU_NAME names another)."""
    if numba.config.CPU_NAME not in (None, "host"):
        return False
    features = llvmlite.binding.get_host_cpu_features()
    return all(features.get(name, False) for name in _FEATURES)


def usable(cols: int) -> bool:
    """Whether rows of ``cols`` q4_0 weights can take ``row_dot`` here."""
    return cols % GROUP_COLS == 0 and available()


def encoded_bytes(cols: int) -> int:
    return cols // GROUP_COLS * ENCODED_GROUP_BYTES


def _vec(t, n):
    return ir.VectorType(t, n)


def _const(t, n, values):
    return ir.Constant(_vec(t, n), list(values))


def _load(builder, addr, ty):
    return builder.load(builder.inttoptr(addr, ty.as_pointer()), align=1)


def _store(builder, value, addr):
    builder.store(value, builder.inttoptr(addr, value.type.as_pointer()), align=1)


def _at(builder, addr, offset):
    return builder.add(addr, ir.Constant(_I64, offset))


def _vpdpbusd(builder, acc, unsigned_bytes, signed_bytes):
    """``acc`` (16 int32) plus, per lane, the sum of four products of unsigned and signed bytes. The
    intrinsic is declared with int32 operands, the form LLVM before 21 takes and newer ones upgrade."""
    i32x16 = _vec(_I32, 16)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32x16, [i32x16] * 3),
                                        "llvm.x86.avx512.vpdpbusd.512")
    return builder.call(fn, [acc, builder.bitcast(unsigned_bytes, i32x16), builder.bitcast(signed_bytes, i32x16)])


def _group_product(builder, row_group, x_group):
    """16 float lanes whose sum is one group's share of the dot product (see the module doc)."""
    first = _load(builder, row_group, _vec(_I8, 64))
    second = _load(builder, _at(builder, row_group, 8), _vec(_I8, 64))  # ends where the group ends
    # block k's nibbles are bytes 18k+2 .. 18k+17 of the group: in `first` below 64, else in `second`
    where = [18 * k + 2 + j for k in range(GROUP_BLOCKS) for j in range(16)]
    packed = builder.shuffle_vector(first, second, _const(_I32, 64, [p if p < 64 else 56 + p for p in where]))
    low = builder.and_(packed, _const(_I8, 64, [0x0F] * 64))
    high = builder.lshr(packed, _const(_I8, 64, [4] * 64))
    sums = _load(builder, _at(builder, x_group, 192), _vec(_I32, 16))  # starts at the -8 offsets
    sums = _vpdpbusd(builder, sums, low, _load(builder, x_group, _vec(_I8, 64)))
    sums = _vpdpbusd(builder, sums, high, _load(builder, _at(builder, x_group, 64), _vec(_I8, 64)))
    words = builder.bitcast(first, _vec(_I16, 32))  # block k's scale is word 9k
    scales = builder.shuffle_vector(words, words, _const(_I32, 16, [9 * (lane // 4) for lane in range(16)]))
    scales = builder.fpext(builder.bitcast(scales, _vec(_HALF, 16)), _vec(_F32, 16))
    scales = builder.fmul(scales, _load(builder, _at(builder, x_group, 128), _vec(_F32, 16)))
    return builder.fmul(builder.sitofp(sums, _vec(_F32, 16)), scales, flags=("contract",))


def _lane_sum(builder, lanes):
    """The sum of a float vector's lanes, halves added pairwise."""
    width = lanes.type.count
    while width > 1:
        width //= 2
        lanes = builder.fadd(builder.shuffle_vector(lanes, lanes, _const(_I32, width, range(width))),
                             builder.shuffle_vector(lanes, lanes, _const(_I32, width, range(width, 2 * width))))
    return builder.extract_element(lanes, ir.Constant(_I32, 0))


@intrinsic
def row_dot(typingctx, row, x, n_groups, ahead):
    """The dot product of the q4_0 row at address ``row`` (``n_groups`` groups of four blocks) with the
    input ``encode`` wrote at address ``x``, as a float32. Each group also asks the cache for the same
    group of the row at ``ahead`` (the next-but-one the caller reads; ``row`` itself when none):
    spread over the work like this, the requests kept scattered rows coming at 11.5 GB/s on two
    threads, against 9.4 GB/s for the whole row's lines asked for up front (``prefetch_span``)."""
    sig = types.float32(types.intp, types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        row_, x_, n_groups_, ahead_ = args
        total = cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, 16), [0.0] * 16))
        with cgutils.for_range(builder, n_groups_) as loop:
            offset = builder.mul(loop.index, ir.Constant(_I64, Q4_0_GROUP_BYTES))
            for last_byte in (0, Q4_0_GROUP_BYTES - 1):  # the group's 72 bytes span two cache lines at most
                prefetch(builder, builder.add(ahead_, builder.add(offset, ir.Constant(_I64, last_byte))))
            product = _group_product(builder, builder.add(row_, offset),
                                     builder.add(x_, builder.mul(loop.index, ir.Constant(_I64, ENCODED_GROUP_BYTES))))
            builder.store(builder.fadd(builder.load(total), product, flags=("contract",)), total)
        return _lane_sum(builder, builder.load(total))

    return sig, codegen


@intrinsic
def _encode_group(typingctx, blocks, out):
    """Rearrange four q8_0 blocks at address ``blocks`` into one encoded group at ``out``."""
    sig = types.void(types.intp, types.intp)

    def codegen(context, builder, signature, args):
        blocks_, out_ = args
        scales, offsets = [], []
        for k in range(GROUP_BLOCKS):
            block = _at(builder, blocks_, k * Q8_0_BLOCK_BYTES)
            values = _load(builder, _at(builder, block, 2), _vec(_I8, BLOCK))
            for half in range(2):
                part = builder.shuffle_vector(values, values, _const(_I32, 16, range(16 * half, 16 * half + 16)))
                _store(builder, part, _at(builder, out_, 64 * half + 16 * k))
            scales.append(builder.fpext(_load(builder, block, _HALF), _F32))
            total = _lane_sum_int(builder, builder.sext(values, _vec(_I32, BLOCK)))
            offsets.append(builder.mul(total, ir.Constant(_I32, -8)))
        for k in range(GROUP_BLOCKS):
            for lane in range(4):
                _store(builder, scales[k], _at(builder, out_, 128 + 4 * (4 * k + lane)))
                offset = offsets[k] if lane == 0 else ir.Constant(_I32, 0)
                _store(builder, offset, _at(builder, out_, 192 + 4 * (4 * k + lane)))
        return context.get_dummy_value()

    return sig, codegen


def _lane_sum_int(builder, lanes):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [lanes.type]),
                                        "llvm.vector.reduce.add.v32i32")
    return builder.call(fn, [lanes])


@njit(nogil=True, cache=True)
def encode(x_q8_0, out, n_groups):
    """ggml's q8_0 encoding of an input (``n_groups`` × 4 blocks, bytes) rearranged for ``row_dot`` into ``out``."""
    for g in range(n_groups):
        _encode_group(x_q8_0.ctypes.data + g * GROUP_BLOCKS * Q8_0_BLOCK_BYTES, out.ctypes.data + g * ENCODED_GROUP_BYTES)


# --- whole matrices interleaved eight rows at a time (kernels.interleaved, ggml's block_q4_0x8) ----------
#
# ggml's own gemv for that layout (AVX2) computes a 2-core VM's q/k/v/o at ~10 GB/s; with VNNI a block
# of eight rows is two 64-byte loads of nibbles and four ``vpdpbusd``: the 16 int32 lanes hold row r's
# sums in lanes 2r and 2r + 1, each over 8 of the block's 32 values. Piece i of the quants is row i % 8's
# bytes 8 * (i // 8) ..: the first 64 bytes hold each row's values 0-7 (low nibbles) and 16-23 (high),
# the second 8-15 and 24-31, so each meets one 8-byte run of x repeated across the rows. The x operand
# is ggml's q8_0 encoding as it is, plus two floats per block from ``block_sums``.

_INTERLEAVED_ROWS = 8
# Each block asks the cache for the bytes 16 blocks on: 2 threads read a 2048 x 2048 matrix from memory
# at ~17 GB/s so, ~15 GB/s without (8 blocks on did no better; the hardware prefetcher alone trails).
_AHEAD_BYTES = 2304
_INTERLEAVED_BLOCK_BYTES = _INTERLEAVED_ROWS * GGML_QUANT_SIZES[GGMLQuantizationType.Q4_0][1]


def _splat_bytes(builder, addr):
    """The 8 bytes at ``addr`` repeated eight times, as 64 int8."""
    one = _load(builder, addr, _I64)
    lanes = builder.insert_element(ir.Constant(_vec(_I64, 8), ir.Undefined), one, ir.Constant(_I32, 0))
    lanes = builder.shuffle_vector(lanes, lanes, _const(_I32, 8, [0] * 8))
    return builder.bitcast(lanes, _vec(_I8, 64))


def _interleaved_block(builder, block, x_block, sums):
    """16 float lanes whose pairs (2r, 2r + 1) sum to row r's share of one 32-column block."""
    nibbles = []
    for half in range(2):  # ggml stores each nibble XOR 8, a signed 4-bit value: undo it
        quants = _load(builder, _at(builder, block, 16 + 64 * half), _vec(_I8, 64))
        for shift in (0, 4):
            part = builder.lshr(quants, _const(_I8, 64, [shift] * 64)) if shift else quants
            nibbles.append(builder.xor(builder.and_(part, _const(_I8, 64, [0x0F] * 64)), _const(_I8, 64, [8] * 64)))
    low_first, high_first, low_second, high_second = nibbles  # values 0-7, 16-23, 8-15, 24-31 of each row
    acc = ir.Constant(_vec(_I32, 16), [0] * 16)
    for values, x_offset in ((low_first, 0), (low_second, 8), (high_first, 16), (high_second, 24)):
        acc = _vpdpbusd(builder, acc, values, _splat_bytes(builder, _at(builder, x_block, 2 + x_offset)))
    halves = _load(builder, block, _vec(_HALF, _INTERLEAVED_ROWS))
    scales = builder.fpext(builder.shuffle_vector(halves, halves, _const(_I32, 16, [lane // 2 for lane in range(16)])),
                           _vec(_F32, 16))
    x_scale, offset = (_splat_float(builder, _load(builder, _at(builder, sums, 4 * k), _F32)) for k in range(2))
    product = builder.fmul(builder.sitofp(acc, _vec(_F32, 16)), builder.fmul(scales, x_scale), flags=("contract",))
    return builder.fadd(product, builder.fmul(scales, offset, flags=("contract",)), flags=("contract",))


def _splat_float(builder, value):
    lanes = builder.insert_element(ir.Constant(_vec(_F32, 16), ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(lanes, lanes, _const(_I32, 16, [0] * 16))


@intrinsic
def interleaved_group(typingctx, group, x_q8_0, sums, n_blocks, out):
    """The eight products of one interleaved group of eight rows (``n_blocks`` blocks of 144 bytes at
    address ``group``) with x (ggml's q8_0 at ``x_q8_0``, ``block_sums`` at ``sums``), as eight floats
    stored at address ``out``."""
    sig = types.void(types.intp, types.intp, types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        group_, x_, sums_, n_blocks_, out_ = args
        total = cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, 16), [0.0] * 16))
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
        rows = builder.fadd(builder.shuffle_vector(lanes, lanes, _const(_I32, 8, range(0, 16, 2))),
                            builder.shuffle_vector(lanes, lanes, _const(_I32, 8, range(1, 16, 2))))
        _store(builder, rows, out_)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _block_sums(typingctx, block, out):
    """For the q8_0 block at ``block``: its scale d and -4 d × the sum of its values, two floats at ``out``
    (each of a row's two lanes adds half of the -8 d × sum that q4_0's offset contributes)."""
    sig = types.void(types.intp, types.intp)

    def codegen(context, builder, signature, args):
        block_, out_ = args
        d = builder.fpext(_load(builder, block_, _HALF), _F32)
        total = _lane_sum_int(builder, builder.sext(_load(builder, _at(builder, block_, 2), _vec(_I8, BLOCK)),
                                                   _vec(_I32, BLOCK)))
        _store(builder, d, out_)
        _store(builder, builder.fmul(builder.fmul(d, ir.Constant(_F32, -4.0)), builder.sitofp(total, _F32)),
               _at(builder, out_, 4))
        return context.get_dummy_value()

    return sig, codegen


@njit(nogil=True, cache=True)
def block_sums(x_q8_0, n_blocks):
    """What ``interleaved_group`` takes beside x's q8_0 encoding: two float32 per block."""
    out = np.empty(2 * n_blocks, np.float32)
    for b in range(n_blocks):
        _block_sums(x_q8_0.ctypes.data + b * Q8_0_BLOCK_BYTES, out.ctypes.data + 8 * b)
    return out
