"""Multi-threaded numba loops over the active rows of a weight matrix, reading it in place.

Two shapes of work, for the two halves of a sparse FFN; both take the weights as their raw bytes
(``[rows, row_bytes]`` uint8) and the weight type as its ggml id:

* ``dot_rows``: ``out[t, i] = W[rows[i]] · x[t]`` (gate/up, dense or gathered). Each product is one
  call to ggml's SIMD ``vec_dot``, whose address is passed in; threads split the rows.
* ``axpy_rows``: ``out[t] += Σ_j coeffs[t, j] · W[rows[j]]`` (the down projection, stored transposed
  as ``ffn_down_t``). Threads split the *rows*, each summing its run into partial outputs of its own;
  each block of four rows is decoded once for all the tokens, and each token's output block loaded and
  stored once for the four (``_rows_axpy``). ``axpy_selected`` (a prompt's tokens, each with its own
  rows) splits the output columns instead. The work per 32-column block is one LLVM vector expression:
  numba's own loops here stay scalar, because LLVM cannot prove that ``out`` and the weights do not
  overlap (one thread, weights in cache: the vector expression is an order of magnitude faster).

Function addresses and thread counts are arguments rather than globals or in-kernel calls, so
``cache=True`` can keep the machine code on disk (a baked-in address would be stale in the next
process, and numba refuses to cache functions that read such "dynamic globals").
"""

from __future__ import annotations

import functools

import llvmlite.binding
import numpy as np
import numba
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from gguf import GGMLQuantizationType
from numba.extending import intrinsic

from powerinfer_tools.formats import activations, weight_types
from powerinfer_tools.formats.weight_types import WEIGHT_TYPES, Kernel, implementations
from powerinfer_tools.kernels.numba_cache import prepare_cache

# q4_0's ggml type id (gguf's GGMLQuantizationType value), as compiled code written for q4_0 alone passes it on
# (the compiled decoder's VNNI gate/up rows: numba_vnni.GATE_UP_TYPES)
Q4_0 = int(weight_types.Q4_0)
# Values a block decoder gives (``BLOCK_DECODERS``): a q4_0 or q8_0 block; f32/f16 rows are walked this many at a time
BLOCK = WEIGHT_TYPES[weight_types.Q4_0].block_size
# The loops ask for the bytes of the active row PREFETCH_ROWS ahead (the axpy spread over its
# work: ``_rows_axpy``): active rows are scattered, so the hardware prefetcher cannot guess the next one.
# Measured on one thread, q4_0 5632x2048 cycling through 260 MB of copies: the hints made 10% of the rows come much
# faster (matvec and axpy), and all rows faster too (matvec). 1, 4 or 8 rows ahead, or prefetching to L2 only, did
# no better (then; with later kernels L2 pays for scattered rows: ``TO_L2``).
PREFETCH_ROWS = 2
# The axpy adds this many rows per load and store of a token's partial sum (``_rows_axpy``), where it used to
# load and store every block of the partial for each row. ``python examples/bench_kernels.py --only-decoder-axpy``
# against the one-row kernel (alternating runs, rows from memory): faster for q4_0 at 10-75% of the rows on
# SmolLM2's and TinyLlama's down projections, and for q8_0 but where memory bounds both (75% of SmolLM2's). A
# prototype with 8 rows did no better than 4. (The tuples of `_four_rows` are spelled out for four.)
ROWS_AT_ONCE = 4
# The options of a loop compiled with fast floating point (LLVM may reorder its sums and assume no NaN or infinity):
# NumPy's error model too, so that its divisions give inf or NaN as NumPy's do, where numba's default raises
# ZeroDivisionError. A NaN weight, which fast code may turn into a 0 divisor (an RMS of NaN whose square root came
# out 0), then reaches the logits as the NumPy reference's NaN does, and the runtime's check of the logits names
# the damaged tensor (``RuntimeModel.forward``) instead of a traceback.
FAST_FLOATS = {"fastmath": True, "error_model": "numpy"}

_I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
_FLOAT = ir.FloatType()
_INTP_BYTES = ir.Constant(_I64, 8)
_PTR = _I8.as_pointer()


def axpy_takes(qtype, cols: int) -> bool:
    """Whether the axpy loops here compute rows of ``cols`` values of ``qtype`` (a ggml type): a type whose row
    claims ``Kernel.AXPY``, in rows a whole number of ``BLOCK`` steps (f32 and f16 rows may be any width). The
    other types' rows are dequantized by ggml's ``to_float`` instead."""
    return WEIGHT_TYPES[GGMLQuantizationType(qtype)].has(Kernel.AXPY) and cols % BLOCK == 0


def type_mask(types) -> int:
    """The ggml type ids ``types`` as the bits of one integer: a constant that compiled code tests with
    ``claimed`` (a type's row claims a kernel), fixed when it is compiled (formats/weight_types.py is among
    ``numba_cache.NUMBA_SOURCES``)."""
    assert all(0 <= int(qtype) < 63 for qtype in types)
    return sum(1 << int(qtype) for qtype in set(types))


@njit(inline="always")
def claimed(mask, qtype):
    """Whether the ggml type id ``qtype`` is among the types of ``mask`` (``type_mask``)."""
    return 0 <= qtype < 63 and (mask >> qtype) & 1 == 1


@njit(inline="always")
def refuse_unclaimed(mask, qtype):
    """Raise for a type outside ``mask``: a compiled kernel's entry point, before its loops reach a switch on the
    type (``switch_on_type``), which has no case for it."""
    if not claimed(mask, qtype):
        raise ValueError("a weight type this kernel has no code for (formats/weight_types.py: the row's kernels)")


def use_threads(n: int) -> int:
    """Run the next kernels from this Python thread on ``n`` threads (numba's setting is per calling
    thread, and capped by NUMBA_NUM_THREADS); returns the count actually used."""
    n = min(n, numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(n)
    return n


@intrinsic
def ggml_from_float(typingctx, fn, x, y, k):
    """Call ggml's ``void from_float(const float *x, void *y, int64_t k)`` at address ``fn``."""
    sig = types.void(types.intp, types.intp, types.intp, types.int64)

    def codegen(context, builder, signature, args):
        fn_addr, x_addr, y_addr, n = args
        fnty = ir.FunctionType(ir.VoidType(), [_PTR, _PTR, _I64])
        callee = builder.inttoptr(fn_addr, fnty.as_pointer())
        builder.call(callee, [builder.inttoptr(x_addr, _PTR), builder.inttoptr(y_addr, _PTR), n])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def ggml_vec_dot(typingctx, fn, n, s, x, y):
    """Call ggml's ``vec_dot(n, s, 0, x, 0, y, 0, 1)`` at address ``fn``: ``*s = x · y`` for one row."""
    sig = types.void(types.intp, types.intp, types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        fn_addr, n_, s_addr, x_addr, y_addr = args
        fnty = ir.FunctionType(ir.VoidType(), [_I32, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I32])
        callee = builder.inttoptr(fn_addr, fnty.as_pointer())
        zero = ir.Constant(_I64, 0)  # strides: unused for a single row (nrc = 1)
        builder.call(callee, [
            builder.trunc(n_, _I32), builder.inttoptr(s_addr, _PTR), zero, builder.inttoptr(x_addr, _PTR), zero,
            builder.inttoptr(y_addr, _PTR), zero, ir.Constant(_I32, 1),
        ])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def ggml_interleaved_product(typingctx, fn, n, s, bs, vx, vy, nr, nc):
    """Call ggml's ``gemv``/``gemm`` over interleaved q4_0 at ``fn`` (``ggml_ops._INTERLEAVED``):
    ``s[t * bs + i] = x_t · W_i`` for ``nr`` tokens and the ``nc`` rows at ``vx``."""
    sig = types.void(*[types.intp] * 8)

    def codegen(context, builder, signature, args):
        fn_addr, n_, s_addr, bs_, vx_addr, vy_addr, nr_, nc_ = args
        fnty = ir.FunctionType(ir.VoidType(), [_I32, _PTR, _I64, _PTR, _PTR, _I32, _I32])
        callee = builder.inttoptr(fn_addr, fnty.as_pointer())
        builder.call(callee, [
            builder.trunc(n_, _I32), builder.inttoptr(s_addr, _PTR), bs_, builder.inttoptr(vx_addr, _PTR),
            builder.inttoptr(vy_addr, _PTR), builder.trunc(nr_, _I32), builder.trunc(nc_, _I32),
        ])
        return context.get_dummy_value()

    return sig, codegen


# --- IR helpers, shared with numba_vnni: addresses are integers, loads unaligned ----------------

def load(builder, addr, ty):
    return builder.load(builder.inttoptr(addr, ty.as_pointer()), align=1)


def splat(builder, value, n):
    """``value`` in each of ``n`` lanes."""
    vec = ir.VectorType(value.type, n)
    one = builder.insert_element(ir.Constant(vec, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined), ir.Constant(ir.VectorType(_I32, n), [0] * n))


def vec(t, n):
    return ir.VectorType(t, n)


def const(t, n, values):
    """An ``n``-lane vector constant of type ``t``."""
    return ir.Constant(vec(t, n), list(values))


def store(builder, value, addr):
    builder.store(value, builder.inttoptr(addr, value.type.as_pointer()), align=1)


def compiles_for(features: tuple[str, ...]) -> bool:
    """Whether numba compiles for a CPU with ``features`` (LLVM's names): the host's features, or those
    NUMBA_CPU_FEATURES lists (NUMBA_CPU_NAME naming another CPU: no)."""
    if numba.config.CPU_FEATURES is not None:
        listed = set(numba.config.CPU_FEATURES.split(","))
        return all(f"+{name}" in listed for name in features)
    if numba.config.CPU_NAME not in (None, "host"):
        return False
    host = llvmlite.binding.get_host_cpu_features()
    return all(host.get(name, False) for name in features)


def offset(builder, addr, n):
    return builder.add(addr, ir.Constant(addr.type, n))


def lane_sum(builder, lanes):
    """The sum of a float vector's lanes (a power of two of them), halves added pairwise."""
    width = lanes.type.count
    while width > 1:
        width //= 2
        lanes = builder.fadd(
            builder.shuffle_vector(lanes, lanes, ir.Constant(ir.VectorType(_I32, width), list(range(width)))),
            builder.shuffle_vector(lanes, lanes,
                                   ir.Constant(ir.VectorType(_I32, width), list(range(width, 2 * width)))))
    return builder.extract_element(lanes, ir.Constant(_I32, 0))


# Where a prefetch hint brings its line (llvm.prefetch's locality). Rows read out of order (a sparse FFN's
# chosen rows) ask for L2 (``prefetcht1``): a line asked for rows ahead then waits in L2 instead of holding one
# of L1's few miss buffers until it arrives, so more lines are on their way at once. ``python
# examples/bench_kernels.py --only-vnni --only-decoder-axpy --shapes tinyllama`` (2 threads, rows from memory)
# compares them: with L2 hints scattered q4_0 rows by numba_vnni, the one-token q4_0 axpy and one thread's
# interleaved q4_0 gemv all came faster, and a plain read of 10% of 1152-byte rows (1 thread) faster with L2 hints
# 4-16 rows ahead than with L1 hints at any distance. Rows read in order (all of a matrix: an output head, a dense
# step) keep L1 hints (``in_order``): L2 hints there made all of TinyLlama's q4_0 rows slower and cost nothing on
# Gemma 3's head (680-byte rows).
TO_L1, TO_L2 = 3, 2


def prefetch(builder, addr, locality=TO_L2):
    """Emit a hint to bring the cache line at ``addr`` (an integer) into the cache for reading: into L2 and
    beyond (``TO_L2``), or into L1 too (``TO_L1``)."""
    fnty = ir.FunctionType(ir.VoidType(), [_PTR, _I32, _I32, _I32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
    read, level, data_cache = (ir.Constant(_I32, v) for v in (0, locality, 1))
    builder.call(fn, [builder.inttoptr(addr, _PTR), read, level, data_cache])


def _prefetch_to(locality):
    @intrinsic
    def prefetch_line(typingctx, addr):
        """``prefetch`` from numba code (``llvm.prefetch``)."""
        sig = types.void(types.intp)

        def codegen(context, builder, signature, args):
            prefetch(builder, args[0], locality)
            return context.get_dummy_value()

        return sig, codegen

    return prefetch_line


_prefetch_l1, _prefetch_l2 = _prefetch_to(TO_L1), _prefetch_to(TO_L2)


F16_CHUNK = 8  # halves f16_row_dot takes at a time


@intrinsic
def f16_row_dot(typingctx, row, x, n):
    """``row · x`` for ``n`` (a multiple of ``F16_CHUNK``) f16 weights at address ``row`` and float32 x at
    ``x`` rounded to f16 (as ggml's f16 ``vec_dot`` takes it), in float32. For narrow rows (a predictor's
    second layer: 8 inputs a row), where a ``vec_dot`` call costs more than the row (TinyLlama's easy
    predictor: 5632 such rows a layer)."""
    sig = types.float32(types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        row_, x_, n_ = args
        chunk = ir.VectorType(_FLOAT, F16_CHUNK)
        total = cgutils.alloca_once_value(builder, ir.Constant(chunk, [0.0] * F16_CHUNK))
        with cgutils.for_range(builder, builder.udiv(n_, ir.Constant(n_.type, F16_CHUNK))) as loop:
            weights = load(builder, builder.add(row_, builder.mul(loop.index, ir.Constant(_I64, 2 * F16_CHUNK))),
                            ir.VectorType(ir.HalfType(), F16_CHUNK))
            values = load(builder, builder.add(x_, builder.mul(loop.index, ir.Constant(_I64, 4 * F16_CHUNK))), chunk)
            values = builder.fpext(builder.fptrunc(values, ir.VectorType(ir.HalfType(), F16_CHUNK)), chunk)
            product = builder.fmul(builder.fpext(weights, chunk), values, flags=("contract",))
            builder.store(builder.fadd(builder.load(total), product, flags=("contract",)), total)
        return lane_sum(builder, builder.load(total))

    return sig, codegen


# The types whose narrow rows ``f16_row_dot`` takes (the compiled decoder's predictor products: ``ffn_decode``)
NARROW_ROW_DOT_TYPES = type_mask(implementations(Kernel.NARROW_ROW_DOT, {weight_types.F16: f16_row_dot}, __name__))


@njit(inline="always")
def prefetch_span(addr, nbytes, order):
    """Ask for the ``nbytes`` at ``addr``: into L1 for rows read in order (``order``, from ``in_order``), into
    L2 for scattered ones."""
    for at in range(0, nbytes, 64):
        if order:
            _prefetch_l1(addr + at)
        else:
            _prefetch_l2(addr + at)


@njit(inline="always")
def in_order(rows):
    """Whether ``rows`` are one run of consecutive rows (first and last ``n - 1`` apart; rows are listed in
    order): the prefetch hints then go to L1, as for a whole matrix, else to L2 (see ``TO_L1``)."""
    n = rows.shape[0]
    return n == 0 or rows[n - 1] - rows[0] == n - 1


@njit(parallel=True, nogil=True, cache=True)
def dot_rows(from_float, vec_dot, weights, rows, x, x_encoded, out):
    """``out[t, i] = weights[rows[i]] · x[t]``; ``x_encoded`` is scratch for x in vec_dot's encoding."""
    n_tokens, cols = x.shape
    for t in range(n_tokens):
        ggml_from_float(from_float, x[t].ctypes.data, x_encoded[t].ctypes.data, cols)
    w_addr, row_bytes = weights.ctypes.data, weights.strides[0]
    xe_addr, xe_stride = x_encoded.ctypes.data, x_encoded.strides[0]
    out_addr, out_stride = out.ctypes.data, out.strides[0]
    n_rows, order = rows.shape[0], in_order(rows)
    for i in prange(n_rows):
        if i + PREFETCH_ROWS < n_rows:
            prefetch_span(w_addr + rows[i + PREFETCH_ROWS] * row_bytes, weights.shape[1], order)
        row_addr = w_addr + rows[i] * row_bytes
        for t in range(n_tokens):  # tokens innermost: the weight row comes from memory once
            ggml_vec_dot(vec_dot, cols, out_addr + t * out_stride + i * 4, row_addr, xe_addr + t * xe_stride)


@njit(parallel=True, nogil=True, cache=True)
def matvec(vec_dot, w, x_encoded, cols, out):
    """``out = W · x`` over all rows of ``w`` (raw rows, ``x`` encoded as ``vec_dot``'s partner type)."""
    for i in prange(w.shape[0]):
        ggml_vec_dot(vec_dot, cols, out.ctypes.data + 4 * i, w.ctypes.data + i * w.strides[0], x_encoded.ctypes.data)


# A neuron's arithmetic as NumPy computes it (``formats/activations.py``), compiled for one value.
activation = njit(inline="always")(activations.activation)
_gated = njit(inline="always")(activations.gated)


@njit(inline="always")
def gated_activation(kind, g, u):
    """One neuron's activated value from its gate and up products, ``kind`` numbered as
    ``formats.activations.NUMBERS`` (what ``models.layers.activate`` computes on arrays)."""
    return _gated(kind, activation(kind, g), u)


# --- block decoders: one block of 32 weights as 32 float lanes, by type; the axpy and numba_dequant's rows ----


def _scale(builder, block):
    """A block's leading f16 scale, as a float."""
    return builder.fpext(load(builder, block, ir.HalfType()), _FLOAT)


# Each decoder returns a block's 32 values as floats and the scale they are to be multiplied by (None
# when they need none), so that a caller can fold its own factor into the scale.

def _decode_q8_0(builder, block):  # f16 scale, then 32 int8
    ints = load(builder, offset(builder, block, 2), ir.VectorType(_I8, BLOCK))
    return builder.sitofp(ints, ir.VectorType(_FLOAT, BLOCK)), _scale(builder, block)


def decode_q4_0(builder, block):  # f16 scale, then 16 bytes: low nibbles are elements 0-15, high 16-31
    # widened to 32 bits first: one zero-extending load, then the nibbles' and/shift in 32-bit lanes
    packed = builder.zext(load(builder, offset(builder, block, 2), ir.VectorType(_I8, 16)), ir.VectorType(_I32, 16))
    low = builder.and_(packed, ir.Constant(ir.VectorType(_I32, 16), [0x0F] * 16))
    high = builder.lshr(packed, ir.Constant(ir.VectorType(_I32, 16), [4] * 16))
    nibbles = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(_I32, BLOCK), list(range(BLOCK))))
    values = builder.sub(nibbles, ir.Constant(ir.VectorType(_I32, BLOCK), [8] * BLOCK))
    return builder.sitofp(values, ir.VectorType(_FLOAT, BLOCK)), _scale(builder, block)


def _decode_f16(builder, block):
    return builder.fpext(load(builder, block, ir.VectorType(ir.HalfType(), BLOCK)), ir.VectorType(_FLOAT, BLOCK)), None


def _decode_f32(builder, block):
    return load(builder, block, ir.VectorType(_FLOAT, BLOCK)), None


# The block decoders by type: those of the kernels that decode rows block by block (the axpy here, numba_dequant)
BLOCK_DECODERS = {weight_types.Q4_0: decode_q4_0, weight_types.Q8_0: _decode_q8_0, weight_types.F16: _decode_f16,
                  weight_types.F32: _decode_f32}
assert all(BLOCK % WEIGHT_TYPES[qtype].block_size == 0 for qtype in BLOCK_DECODERS)
AXPY_DECODERS = implementations(Kernel.AXPY, BLOCK_DECODERS, __name__)  # the types the axpy takes
AXPY_TYPES = type_mask(AXPY_DECODERS)


def switch_on_type(builder, qtype, cases):
    """Emit the code of ``cases[t]`` (``{ggml type: emitter}``, each called with no arguments) for the type whose
    id is the integer value ``qtype``, and return the values they return as one (None where they return none; a
    list of one per position where they return lists). Another type traps: the entry points of the compiled
    kernels refuse every type outside their table first (``refuse_unclaimed``), so none reaches here."""
    done, other = builder.append_basic_block("typed"), builder.append_basic_block("no_case_for_type")
    switch = builder.switch(qtype, other)
    results = []
    for case_type, emit in cases.items():
        case = builder.append_basic_block(f"type_{int(case_type)}")
        switch.add_case(ir.Constant(qtype.type, int(case_type)), case)
        builder.position_at_end(case)
        results.append((emit(), builder.block))
        builder.branch(done)
    builder.position_at_end(other)
    builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.trap"), [])
    builder.unreachable()
    builder.position_at_end(done)
    if not results or results[0][0] is None:
        return None
    if isinstance(results[0][0], list):
        return [meet(builder, [(values[i], block) for values, block in results]) for i in range(len(results[0][0]))]
    return meet(builder, results)


def meet(builder, incoming):
    """The value of ``incoming``'s (value, block) pairs whose block the code came from: one phi."""
    value = builder.phi(incoming[0][0].type)
    for result, block in incoming:
        value.add_incoming(result, block)
    return value


# --- the axpy: one block of 32 weights, decoded once, added to every token's output --------------


def _times(builder, values, factor):
    """``values`` (32 floats) times the scalar ``factor`` (None: unchanged)."""
    return values if factor is None else builder.fmul(values, splat(builder, factor, BLOCK), flags=("contract",))


@intrinsic
def _block_axpy(typingctx, qtype, out, out_stride, block, coeffs, coeffs_stride, tokens, n_tokens):
    """``f(qtype, out, out_stride, block, coeffs, coeffs_stride, tokens, n_tokens)`` (a type of ``AXPY_DECODERS``,
    addresses and byte strides) doing ``out[t][0:32] += coeffs[t] * decode(block)`` for the ``n_tokens`` tokens t
    whose intp ids are stored at ``tokens``. The block is decoded once for all of them, by its type's decoder."""
    sig = types.void(*[types.intp] * 8)

    def codegen(context, builder, signature, args):
        qtype_, out_, out_stride_, block_, coeffs_, coeffs_stride_, tokens_, n_tokens_ = args

        def block_axpy(decode):
            values, scale = decode(builder, block_)
            with cgutils.for_range(builder, n_tokens_) as loop:
                token = load(builder, builder.add(tokens_, builder.mul(loop.index, _INTP_BYTES)), _I64)
                coeff = load(builder, builder.add(coeffs_, builder.mul(token, coeffs_stride_)), _FLOAT)
                coeff = coeff if scale is None else builder.fmul(scale, coeff)  # as ``_rows_axpy``: the same sums
                target = builder.inttoptr(builder.add(out_, builder.mul(token, out_stride_)),
                                          ir.VectorType(_FLOAT, BLOCK).as_pointer())
                total = builder.fadd(builder.load(target, align=4), _times(builder, values, coeff),
                                     flags=("contract",))
                builder.store(total, target, align=4)

        switch_on_type(builder, qtype_, {t: functools.partial(block_axpy, d) for t, d in AXPY_DECODERS.items()})
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _rows_axpy(typingctx, qtype, out, out_stride, n_tokens, rows, coeffs, coeffs_stride, n_blocks, block_bytes,
               ahead):
    """``f(qtype, out, out_stride, n_tokens, rows, coeffs, coeffs_stride, n_blocks, block_bytes, ahead)`` doing,
    for each of ``n_tokens`` tokens t, ``out_t[0:32n] += Σ_r coeffs_t[r] × row r`` over a tuple of row addresses
    of a type of ``AXPY_DECODERS``: token t's output at ``out + t·out_stride``, its float32 coefficients (one per
    row, consecutive) at ``coeffs + t·coeffs_stride``; ``ahead``: the addresses of the rows the caller reads next.
    Each block of the rows is decoded once for all the tokens, then each token's block of ``out`` is loaded and
    stored once for all of the rows, each row's block scale times its coefficient once, one multiply-add per
    weight (no per-row load and store of the output, as ``_block_axpy`` has). The rows are added in order, so
    the sums are those of one row at a time. Each block also asks the cache for the same block of the ``ahead``
    rows: spread over the work like this, rather than up front, the requests kept scattered q4_0 rows coming
    faster (a one-off comparison while writing it, two threads)."""
    n_rows = rows.count
    sig = types.void(types.intp, types.intp, types.intp, types.intp, types.UniTuple(types.intp, n_rows), types.intp,
                     types.intp, types.intp, types.intp, types.UniTuple(types.intp, n_rows))

    def codegen(context, builder, signature, args):
        qtype_, out_, out_stride_, n_tokens_, rows_, coeffs_, coeffs_stride_, n_blocks_, block_bytes_, ahead_ = args
        rows_, ahead_ = ([builder.extract_value(t, r) for r in range(n_rows)] for t in (rows_, ahead_))

        def rows_axpy(decode):
            with cgutils.for_range(builder, n_blocks_) as loop:
                at = builder.mul(loop.index, block_bytes_)
                decoded = []
                for row, next_row in zip(rows_, ahead_):
                    prefetch(builder, builder.add(next_row, at))
                    decoded.append(decode(builder, builder.add(row, at)))
                block_out = builder.add(out_, builder.mul(loop.index, ir.Constant(_I64, 4 * BLOCK)))
                with cgutils.for_range(builder, n_tokens_) as token:
                    target = builder.inttoptr(builder.add(block_out, builder.mul(token.index, out_stride_)),
                                              ir.VectorType(_FLOAT, BLOCK).as_pointer())
                    token_coeffs = builder.add(coeffs_, builder.mul(token.index, coeffs_stride_))
                    total = builder.load(target, align=4)
                    for r, (values, scale) in enumerate(decoded):
                        coeff = load(builder, builder.add(token_coeffs, ir.Constant(_I64, 4 * r)), _FLOAT)
                        factor = coeff if scale is None else builder.fmul(scale, coeff)
                        total = builder.fadd(total, _times(builder, values, factor), flags=("contract",))
                    builder.store(total, target, align=4)

        switch_on_type(builder, qtype_, {t: functools.partial(rows_axpy, d) for t, d in AXPY_DECODERS.items()})
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always")
def _axpy_selected(qtype, weights, rows, starts, tokens, coeffs, out, n_threads):
    """``out[t] += coeffs[t, j] · W[rows[j]]`` for the tokens ``tokens[starts[j]:starts[j + 1]]`` of row j, the
    threads splitting the output columns: a row's tokens are few and differ from row to row, so each thread keeps
    its columns of every token's output in its cache."""
    refuse_unclaimed(AXPY_TYPES, qtype)
    cols = out.shape[1]
    n_blocks = cols // BLOCK
    n_chunks = min(n_threads, n_blocks)
    w_addr, row_stride = weights.ctypes.data, weights.strides[0]
    block_bytes = weights.shape[1] // n_blocks
    c_addr, c_stride = coeffs.ctypes.data, coeffs.strides[0]
    out_addr, out_stride = out.ctypes.data, out.strides[0]
    t_addr = tokens.ctypes.data
    n_rows, order = rows.shape[0], in_order(rows)
    for chunk in prange(n_chunks):
        first, stop = chunk * n_blocks // n_chunks, (chunk + 1) * n_blocks // n_chunks
        for j in range(n_rows):
            if j + PREFETCH_ROWS < n_rows:  # only this thread's share of that row
                prefetch_span(w_addr + rows[j + PREFETCH_ROWS] * row_stride + first * block_bytes,
                               (stop - first) * block_bytes, order)
            row_addr, listed, count = w_addr + rows[j] * row_stride, t_addr + starts[j] * 8, starts[j + 1] - starts[j]
            for b in range(first, stop):
                _block_axpy(qtype, out_addr + b * BLOCK * 4, out_stride, row_addr + b * block_bytes, c_addr + j * 4,
                            c_stride, listed, count)


@njit(parallel=True, nogil=True, cache=True)
def axpy_rows(qtype, weights, rows, coeffs, out, n_threads):
    """``out[t] += Σ_j coeffs[t, j] · W[rows[j]]`` for every token t, the threads sharing the rows: each sums
    its run of rows into partials of its own (one output row per token), added to ``out`` in thread order.
    Splitting each row's columns between the threads instead made each thread's share of a 1152-byte q4_0 row
    too short to stream, and loaded and stored every token's output block once per row: slower from 1 to 32
    tokens but for 16, as fast; above 32 (the matrix kernels' blocks: ``kernels.MAX_TOKENS``) the partials
    outgrow the cache and it is the faster (docs/lab/kernels.md, "A batch's products"). Columns a multiple
    of 32."""
    _axpy_rows(qtype, weights, rows, coeffs, out, n_threads, coeffs.shape[0])


@njit(parallel=True, nogil=True, cache=True)
def axpy_rows_one_token(qtype, weights, rows, coeffs, out, n_threads):
    """``axpy_rows`` of one token (a decoded one), its token count a constant the compiler folds away."""
    _axpy_rows(qtype, weights, rows, coeffs, out, n_threads, 1)


@njit(inline="always")
def _axpy_rows(qtype, weights, rows, coeffs, out, n_threads, n_tokens):
    partial = row_partials(rows.shape[0], n_tokens, out.shape[1], n_threads)
    _rows_into_partials(qtype, weights, rows, coeffs, partial, 0, rows.shape[0], n_tokens)
    add_partials(partial, out)


@njit(nogil=True, cache=True)
def axpy_rows_one_token_part(qtype, weights, rows, coeffs, partial, first, total):
    """The rows at positions ``first ..`` of an ``axpy_rows_one_token`` over ``total`` rows, into its
    ``partial`` (``row_partials``): a product whose rows come in consecutive parts (a neuron cache
    streaming them) sums exactly as the whole one does once ``add_partials`` ends it. One thread does
    every partial's share in turn (the same sums): a part is small, and its caller's disk reads keep
    the other cores busy, so a parallel region per part waited on threads descheduled by them."""
    _rows_into_partials(qtype, weights, rows, coeffs, partial, first, total, 1)


@njit(nogil=True, cache=True)
def row_partials(total, n_tokens, cols, n_threads):
    """The partial sums of ``axpy_rows`` over ``total`` rows: ``n_tokens`` output rows for each thread's run."""
    return np.zeros((max(1, min(n_threads, total)) * n_tokens, cols), np.float32)


@njit(nogil=True, cache=True)
def add_partials(partial, out):
    n_tokens = out.shape[0]
    for chunk in range(partial.shape[0] // n_tokens):
        for t in range(n_tokens):
            for c in range(out.shape[1]):
                out[t, c] += partial[chunk * n_tokens + t, c]


@njit(inline="always")
def _rows_into_partials(qtype, weights, rows, coeffs, partial, first, total, n_tokens):
    """Rows ``rows`` (positions ``first ..`` of ``total``), times ``coeffs``, each added to the partials of the
    thread whose run of the ``total`` positions holds it."""
    refuse_unclaimed(AXPY_TYPES, qtype)
    n_chunks, cols = partial.shape[0] // n_tokens, partial.shape[1]
    n_blocks = cols // BLOCK
    block_bytes = weights.shape[1] // n_blocks
    w_addr, row_stride = weights.ctypes.data, weights.strides[0]
    p_addr, p_stride = partial.ctypes.data, partial.strides[0]
    c_addr, c_stride = coeffs.ctypes.data, coeffs.strides[0]
    end = first + rows.shape[0]
    for chunk in prange(n_chunks):
        start, stop = max(first, chunk * total // n_chunks) - first, min(end, (chunk + 1) * total // n_chunks) - first
        out = p_addr + chunk * n_tokens * p_stride
        j = start
        while j + ROWS_AT_ONCE <= stop:
            _rows_axpy(qtype, out, p_stride, n_tokens, _four_rows(w_addr, row_stride, rows, j, stop), c_addr + j * 4,
                       c_stride, n_blocks, block_bytes, _four_rows(w_addr, row_stride, rows, j + ROWS_AT_ONCE, stop))
            j += ROWS_AT_ONCE
        for j in range(j, stop):
            ahead = (w_addr + rows[min(j + PREFETCH_ROWS, stop - 1)] * row_stride,)
            _rows_axpy(qtype, out, p_stride, n_tokens, (w_addr + rows[j] * row_stride,), c_addr + j * 4, c_stride,
                       n_blocks, block_bytes, ahead)


@njit(inline="always")
def _four_rows(w_addr, row_stride, rows, j, stop):
    """The addresses of rows ``rows[j .. j + 3]``, each position past ``stop - 1`` taken as that one."""
    last = stop - 1
    return (w_addr + rows[min(j, last)] * row_stride, w_addr + rows[min(j + 1, last)] * row_stride,
            w_addr + rows[min(j + 2, last)] * row_stride, w_addr + rows[min(j + 3, last)] * row_stride)


@njit(parallel=True, nogil=True, cache=True)
def axpy_selected(qtype, weights, rows, starts, tokens, coeffs, out, n_threads):
    """``out[t] += coeffs[t, j] · W[rows[j]]`` for just the tokens ``t in tokens[starts[j]:starts[j + 1]]``
    that selected row j (a prompt, each token with its own neurons; ``tokens`` intp): each row is
    read and decoded once for all of its tokens, not once per token. Columns a multiple of 32."""
    _axpy_selected(qtype, weights, rows, starts, tokens, coeffs, out, n_threads)


prepare_cache(globals())  # stale machine code flushed, the rest loaded without the compiler (kernels.numba_cache)
