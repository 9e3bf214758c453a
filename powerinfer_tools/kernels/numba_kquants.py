"""q4_K rows times one token with AVX-512 VNNI, behind ggml's own ``vec_dot`` interface.

Most of a Q4_K_M file's bytes are q4_K rows, and ggml's ``vec_dot`` for them is 256-bit code whose arithmetic held
a token back here (docs/lab/kernels.md, "k-quants"). The function here takes the same arguments as ggml's
and the same input, ggml's own q8_K encoding of x (a float32 scale, 256 int8, the sums of each 16 of them), so it
stands in for ggml's wherever the runtime calls a ``vec_dot`` by its address (``kernels`` chooses it once, at load,
through ``ggml_ops.GgmlCpu.with_vec_dots``). The weights keep their type and their bytes; the sums are ggml's integer
sums, combined in float32 in another order. (q6_K rows are left to ggml's ``vec_dot``, which keeps up with memory.)

A q4_K super-block (144 bytes: f16 d and dmin, twelve bytes of six-bit scales and mins for eight 32-value
sub-blocks, 128 bytes of nibbles) is four steps of 64 values; step j's 32 bytes hold sub-block 2j in their low
nibbles and 2j + 1 in their high ones, which become one 64-byte operand of unsigned values in x's own order, so x's
bytes are read as ggml wrote them. ``vpmaddubsw`` multiplies them with x's 64 int8 and adds pairs into 32 int16
lanes (16 a sub-block), ``vpdpwssd`` multiplies those with the sub-blocks' scales and adds them into 16 int32 lanes;
the mins meet x's sums of 16 (``vpmaddwd``) apart, since dmin is not d.

Needs AVX-512 F/BW/VNNI (``available``); elsewhere ggml's ``vec_dot`` runs.
"""

from __future__ import annotations

import functools

from gguf import GGML_QUANT_SIZES
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from powerinfer_tools.formats import weight_types
from powerinfer_tools.formats.weight_types import WEIGHT_TYPES, Kernel, implementations
from powerinfer_tools.kernels.numba_cache import cached_cfuncs, prepare_cache
from powerinfer_tools.kernels.numba_kernels import compiles_for, const, lane_sum, load, offset, splat, vec

_FEATURES = ("avx512f", "avx512bw", "avx512vnni")
_SUPER_BLOCK = WEIGHT_TYPES[weight_types.Q4_K].block_size  # 256 values
# ggml's block_q8_K: float d, int8 qs[256], int16 bsums[16] (the sum of each 16 values)
_X_VALUES, _X_SUMS = 4, 4 + _SUPER_BLOCK
_X_BYTES = GGML_QUANT_SIZES[weight_types.Q8_K][1]

_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_HALF = ir.HalfType()


@functools.cache
def available() -> bool:
    """Whether numba compiles for a CPU with the instructions these kernels use (``numba_kernels.compiles_for``)."""
    return compiles_for(_FEATURES)


def _call(builder, name, result, *operands):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(result, [a.type for a in operands]), name)
    return builder.call(fn, list(operands))


def _pair_products(builder, weights, x):
    """``vpmaddubsw``: 32 int16 lanes, each the sum of two products of unsigned weight bytes with x's int8."""
    return _call(builder, "llvm.x86.avx512.pmaddubs.w.512", vec(_I16, 32), weights, x)


def _scaled_sum(builder, acc, pairs, scales):
    """``vpdpwssd``: ``acc`` (16 int32) plus, per lane, the two int16 ``pairs`` times their int16 ``scales``.
    Declared with int32 operands, the form LLVM before 21 takes and newer ones upgrade."""
    i32x16 = vec(_I32, 16)
    return _call(builder, "llvm.x86.avx512.vpdpwssd.512", i32x16, acc, builder.bitcast(pairs, i32x16),
                 builder.bitcast(scales, i32x16))


def _sums_times(builder, x_block, factors):
    """x's sixteen sums of 16 values times the sixteen int16 ``factors``, added in pairs: 8 int32 (``vpmaddwd``)."""
    sums = load(builder, offset(builder, x_block, _X_SUMS), vec(_I16, 16))
    return _call(builder, "llvm.x86.avx2.pmadd.wd", vec(_I32, 8), sums, factors)


def _nibbles(builder, quants):
    """The 32 bytes' low nibbles, then their high ones: 64 unsigned bytes. The bytes are shifted as int16 words
    (AVX-512 has no byte shift), the bits that cross into the neighbouring byte masked off."""
    both = builder.bitcast(builder.shuffle_vector(quants, quants, const(_I32, 64, list(range(32)) * 2)),
                           vec(_I16, 32))
    shifted = builder.bitcast(builder.lshr(both, const(_I16, 32, [0] * 16 + [4] * 16)), vec(_I8, 64))
    return builder.and_(shifted, const(_I8, 64, [0x0F] * 64))


def _super_block(builder, block, x_block):
    """One q4_K super-block times x's: (16 float lanes summing to its d part, 8 float lanes summing to its dmin
    part, to be taken off)."""
    x_scale = load(builder, x_block, _F32)
    d = builder.fmul(builder.fpext(load(builder, block, _HALF), _F32), x_scale)
    dmin = builder.fmul(builder.fpext(load(builder, offset(builder, block, 2), _HALF), _F32), x_scale)
    # Six-bit scales and mins of the eight sub-blocks: bytes 0-3 hold scales 0-3 and the top bits of scales 4-7,
    # bytes 4-7 mins 0-3 and the top bits of mins 4-7, bytes 8-11 the low four bits of scales and mins 4-7.
    first, second, third = (load(builder, offset(builder, block, 4 + 4 * k), _I32) for k in range(3))
    low6, low4, top2 = (ir.Constant(_I32, m) for m in (0x3F3F3F3F, 0x0F0F0F0F, 0x30303030))
    two, four = ir.Constant(_I32, 2), ir.Constant(_I32, 4)
    words = [
        builder.and_(first, low6),  # scales 0-3
        builder.or_(builder.and_(third, low4), builder.and_(builder.lshr(first, two), top2)),  # scales 4-7
        builder.and_(second, low6),  # mins 0-3
        builder.or_(builder.and_(builder.lshr(third, four), low4), builder.and_(builder.lshr(second, two), top2)),
    ]
    packed = ir.Constant(vec(_I32, 4), ir.Undefined)
    for k, word in enumerate(words):
        packed = builder.insert_element(packed, word, ir.Constant(_I32, k))
    six_bits = builder.zext(builder.bitcast(packed, vec(_I8, 16)), vec(_I16, 16))  # scales 0-7, mins 0-7
    acc = ir.Constant(vec(_I32, 16), [0] * 16)
    for step in range(4):  # values 64 j .. 64 j + 63: sub-blocks 2j and 2j + 1
        weights = _nibbles(builder, load(builder, offset(builder, block, 16 + 32 * step), vec(_I8, 32)))
        x = load(builder, offset(builder, x_block, _X_VALUES + 64 * step), vec(_I8, 64))
        scales = builder.shuffle_vector(six_bits, six_bits, const(_I32, 32, [2 * step] * 16 + [2 * step + 1] * 16))
        acc = _scaled_sum(builder, acc, _pair_products(builder, weights, x), scales)
    mins = builder.shuffle_vector(six_bits, six_bits, const(_I32, 16, [8 + k // 2 for k in range(16)]))
    main = builder.fmul(builder.sitofp(acc, vec(_F32, 16)), splat(builder, d, 16), flags=("contract",))
    offsets = builder.fmul(builder.sitofp(_sums_times(builder, x_block, mins), vec(_F32, 8)), splat(builder, dmin, 8),
                           flags=("contract",))
    return main, offsets


def _emit_dot(builder, row, x, n_blocks):
    """The float32 product of the q4_K row at address ``row`` (``n_blocks`` super-blocks) with x (q8_K)."""
    block_bytes = ir.Constant(_I64, WEIGHT_TYPES[weight_types.Q4_K].block_bytes)
    main = cgutils.alloca_once_value(builder, ir.Constant(vec(_F32, 16), [0.0] * 16))
    taken_off = cgutils.alloca_once_value(builder, ir.Constant(vec(_F32, 8), [0.0] * 8))
    with cgutils.for_range(builder, n_blocks) as loop:
        block = builder.add(row, builder.mul(loop.index, block_bytes))
        x_block = builder.add(x, builder.mul(loop.index, ir.Constant(_I64, _X_BYTES)))
        lanes, offsets = _super_block(builder, block, x_block)
        builder.store(builder.fadd(builder.load(main), lanes, flags=("contract",)), main)
        builder.store(builder.fadd(builder.load(taken_off), offsets, flags=("contract",)), taken_off)
    return builder.fsub(lane_sum(builder, builder.load(main)), lane_sum(builder, builder.load(taken_off)))


@intrinsic
def _dot_into(typingctx, n, s, vx, vy):
    """``*s = row · x`` for the ``n`` q4_K weights at ``vx`` and x's q8_K encoding at ``vy``."""
    sig = types.void(types.int32, types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        n_, s_, vx_, vy_ = args
        n_blocks = builder.udiv(builder.sext(n_, _I64), ir.Constant(_I64, _SUPER_BLOCK))
        builder.store(_emit_dot(builder, vx_, vy_, n_blocks), builder.inttoptr(s_, _F32.as_pointer()))
        return context.get_dummy_value()

    return sig, codegen


# ggml's vec_dot: void (int n, float *s, size_t bs, const void *vx, size_t bx, const void *vy, size_t by, int nrc),
# pointers passed as the integers they are; one row (nrc = 1), as the runtime calls it.
_VEC_DOT = types.void(types.int32, types.intp, types.uintp, types.intp, types.uintp, types.intp, types.uintp,
                      types.int32)


def _q4_k_vec_dot(n, s, bs, vx, bx, vy, by, nrc):
    _dot_into(n, s, vx, vy)


_VEC_DOTS = implementations(Kernel.VNNI_VEC_DOT, {weight_types.Q4_K: _q4_k_vec_dot}, __name__)


@functools.cache
def vec_dot_addresses() -> dict[int, int]:
    """By ggml type id, the address of this module's ``vec_dot`` for each type that claims ``Kernel.VNNI_VEC_DOT``;
    empty where the CPU lacks the instructions. Compiled on the first call, not at import: compiling them for a CPU
    without the instructions would fail. Their machine code is cached on disk by numba, flushed first where it was
    made from other sources and loaded without numba's compiler (``numba_cache.cached_cfuncs``)."""
    if not available():
        return {}
    compiled = cached_cfuncs(list(_VEC_DOTS.values()), _VEC_DOT, __file__)
    return {int(qtype): function.address for qtype, function in zip(_VEC_DOTS, compiled)}


prepare_cache(globals())  # (no dispatcher here: the cfuncs' caches are prepared as they are made, above)
