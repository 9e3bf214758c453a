"""Compiled CPU kernels for the FFN hot loops, on weights read in place (``formats/weight_types.py``).

    matvec(m, x, rows)        x [T, cols] @ W[rows].T  -> [T, len(rows)]   gate/up, dense or gathered
    row_axpy(m, coeffs, rows) coeffs [T, k] @ W[rows]  -> [T, cols]        down projection (ffn_down_t)
    interleaved_matmul(p, x)  x [T, cols] @ W.T        -> [T, rows]        a q4_0 matrix used whole, any T
    causal_attention(q, k, v, ...)                                        a prompt's attention (numba_attention)
    one_query_each(q, stored, ...)                                        a batch's step's attention (numba_attention)
    block_matmul, block_row_sum                                           matvec's and row_axpy's products
                                                                          for a prompt: dequantized for BLAS
    bf16_matmul, bf16_row_sum                                             the same in bfloat16 products (AVX-512
                                                                          BF16; row_sum: q4_0 rows)

``rows=None`` means every row. Both match ``QuantMatrix.matmul`` / ``weighted_row_sum``, the NumPy
reference, except that ``matvec`` encodes x the way llama.cpp does before ``vec_dot``: as the weight
type's ``vec_dot_type`` (q8_0 for q4_0/q8_0/q5_0, q8_1 for q4_1/q5_1, q8_K for the k-quants: ~5e-3
relative error), as f16 for f16 weights. ``row_axpy`` is exact up to float32 summation order; the
types without decoders of ours (and f32/f16 matrices whose width is not a multiple of 32) take the
reference, whose rows ggml's ``to_float`` dequantizes.

They are meant for decoding (T up to ``MAX_TOKENS``); larger batches, i.e. prompt processing, take the
block products, which dequantize a chunk of rows at a time and hand it to OpenBLAS. When the compiled
path cannot load (llama-cpp-python or numba missing, or a ggml ABI that fails ``ggml_ops``'s
checks), both functions fall back to the reference with one warning; ``available()``,
``unavailable_reason()`` and ``describe()`` say which path runs.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from pathlib import Path

import numpy as np

from powerinfer_tools.formats.weight_types import WEIGHT_TYPES, Kernel
from powerinfer_tools.kernels import ggml_ops
from powerinfer_tools.kernels.interleaved import ROWS, InterleavedQ4, can_interleave, interleave
from powerinfer_tools.kernels.quant import QuantMatrix

MAX_TOKENS = 32  # above this the reference's dequantize + BLAS is faster (docs/lab/kernels.md, "crossover")
ATTENTION_MIN_TOKENS = 4  # a tile of numba_attention's (its QUERIES): fewer queries take NumPy's attention

_threads = os.cpu_count() or 1
_reference_reason: str | None = None  # set by use_reference: this process keeps to the NumPy reference


def use_reference(reason: str | None) -> None:
    """From now on in this process, the NumPy reference kernels, for ``reason`` (as if numba were missing:
    nothing is compiled, numba is not even imported); None: the compiled kernels again, where they load.
    A model loaded before a change keeps the layouts it was loaded with (``for_whole_products``)."""
    global _reference_reason
    if reason != _reference_reason:
        _reference_reason = reason
        _backend.cache_clear()


def load_cpu_library() -> None:
    """Load ggml's CPU library now, and with it the OpenMP runtime of the compiled kernels' parallel loops, which
    reads its settings (``OMP_WAIT_POLICY``) once, as it loads: for a process that keeps to the reference for now,
    within settings made for its load (``commands.options``), and turns to the compiled kernels later. Where the
    library cannot load, nothing: ``unavailable_reason`` says why when the compiled kernels are asked for."""
    try:
        ggml_ops.load()
    except ggml_ops.GgmlUnavailable:
        pass


def reference_chosen() -> bool:
    """Whether ``use_reference`` chose the NumPy reference for this process."""
    return _reference_reason is not None


def available() -> bool:
    """True when the compiled kernels loaded and passed their checks."""
    return not isinstance(_backend(), str)


def unavailable_reason() -> str | None:
    """Why the compiled kernels are not used, or None when they are."""
    backend = _backend()
    return backend if isinstance(backend, str) else None


def describe() -> str:
    """One line for logs: which path runs, and with what."""
    backend = _backend()
    if isinstance(backend, str):
        return f"NumPy reference ({backend})"
    ggml = backend[1]
    gemv = ", q4_0 interleaved for its gemv/gemm" if ggml.interleaved else ""
    ours = sorted(WEIGHT_TYPES[qtype].name for qtype in ggml.vec_dots_of_ours)
    vec_dots = f" (AVX-512 VNNI vec_dot of ours for {', '.join(ours)})" if ours else ""
    return (f"compiled: numba loops + ggml vec_dot{vec_dots}{gemv} from {ggml.library} "
            f"(llama-cpp-python {ggml.version}), {_threads} threads")


def vec_dot_name(qtype) -> str:
    """Whose ``vec_dot`` multiplies one token's rows of ``qtype`` here: ``AVX-512 VNNI vec_dot`` where
    ``numba_kquants``'s stands in for ggml's (``GgmlCpu.with_vec_dots``), else ``ggml vec_dot``."""
    ggml = ggml_routines()
    return "AVX-512 VNNI vec_dot" if ggml is not None and qtype in ggml.vec_dots_of_ours else "ggml vec_dot"


def ggml_routines() -> ggml_ops.GgmlCpu | None:
    """The checked ggml routines the compiled kernels call, or None when they cannot load."""
    backend = _backend()
    return None if isinstance(backend, str) else backend[1]


def set_threads(n: int) -> None:
    """Threads the kernels use from now on (default: ``os.cpu_count()``)."""
    global _threads
    if n < 1:
        raise ValueError(f"thread count must be at least 1, got {n}")
    _threads = n


def get_threads() -> int:
    return _threads


def idle_cores() -> float:
    """Cores that other work leaves this process now: the CPU count less the threads of other processes running
    or ready to run (``others_running``), for choices that depend on whether it competes for a core. Not the
    1-minute load average: that still counts the work of the minutes before (a previous run, a build) for
    minutes after it ended."""
    return (os.cpu_count() or 1) - others_running()


def others_running(samples: int = 10, interval: float = 0.01) -> int:
    """Threads of other processes running or ready to run now: the fewest that the kernel's count of
    runnable threads (``/proc/loadavg``'s fourth field, this thread included) showed over ``samples``
    looks (work that holds a core shows in every one); 0 where the count cannot be read."""
    counts = []
    for _ in range(samples):
        try:
            counts.append(int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]) - 1)
        except (OSError, IndexError, ValueError):
            return 0
        time.sleep(interval)
    return max(0, min(counts))


def matvec(m: QuantMatrix, x: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """``x [T, cols] @ W[rows].T`` as float32 ``[T, len(rows)]`` (all rows when ``rows`` is None)."""
    backend = _compiled_or_none(x.shape[0])
    if backend is None:
        return m.matmul(x, rows)
    nk, ggml, _ = backend
    x = _checked_input(x, m.cols, "x")
    rows = _checked_rows(m, rows)
    routine = ggml.routines[m.qtype]
    out = np.empty((x.shape[0], len(rows)), dtype=np.float32)
    x_encoded = np.empty((x.shape[0], routine.encoded_bytes(m.cols)), dtype=np.uint8)
    from powerinfer_tools.kernels import numba_vnni  # needs numba, which the compiled path has

    if numba_vnni.usable(int(m.qtype), m.cols):  # AVX-512 VNNI where the CPU has it
        scratch = np.empty((x.shape[0], numba_vnni.encoded_bytes(int(m.qtype), m.cols)), np.uint8)
        numba_vnni.dot_rows(int(m.qtype), routine.from_float, weight_bytes(m), rows, x, x_encoded, scratch, out)
        return out
    nk.dot_rows(routine.from_float, routine.vec_dot, weight_bytes(m), rows, x, x_encoded, out)
    return out


def row_axpy(m: QuantMatrix, coeffs: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """``coeffs [T, k] @ W[rows]`` as float32 ``[T, cols]``: the axpy over active rows of ``ffn_down_t``."""
    backend = _compiled_or_none(coeffs.shape[0])
    if backend is None or not backend[0].axpy_takes(m.qtype, m.cols):
        return m.weighted_row_sum(coeffs, rows)
    nk, _, threads = backend
    rows = _checked_rows(m, rows)
    coeffs = _checked_input(coeffs, len(rows), "coeffs")
    out = axpy_output(coeffs.shape[0], m.cols)
    nk.axpy_rows(int(m.qtype), weight_bytes(m), rows, coeffs, out, threads)
    return out


def vnni_rows(m: QuantMatrix) -> bool:
    """Whether one token's rows of ``m``, read one by one, take ``numba_vnni``'s row product over all their
    columns here (the compiled decoder's gate and up rows, ``ffn_decode.rows_take_vnni``: a type that claims
    ``Kernel.VNNI_GATE_UP``, q4_0; a tail of columns short of its groups goes through ggml's ``vec_dot``)."""
    if not available() or not WEIGHT_TYPES[m.qtype].has(Kernel.VNNI_GATE_UP):
        return False
    from powerinfer_tools.kernels import numba_vnni  # needs numba, which the compiled path has

    return m.cols % numba_vnni.GROUP_COLS == 0 and numba_vnni.available()


def interleaves(m: QuantMatrix) -> bool:
    """Whether ``for_whole_products`` gives ``m`` a new layout here."""
    ggml = ggml_routines()
    return ggml is not None and ggml.interleaved is not None and can_interleave(m)


def for_whole_products(m: QuantMatrix) -> QuantMatrix | InterleavedQ4:
    """``m`` as the CPU best multiplies a matrix that is always used whole (attention, the output head, a
    dense file's FFN): interleaved where ggml's kernels for that layout run here (``kernels.interleaved``),
    else as it is. The copy is made by the compiled loop where the compiled kernels are in use, else by NumPy
    (as while they are being built: nothing is compiled for it then)."""
    if not interleaves(m):
        return m
    if isinstance(_backend(), str):
        return interleave(m)
    from powerinfer_tools.kernels import numba_interleaved

    out = np.empty((m.rows // ROWS, ROWS * m.row_bytes), np.uint8)
    numba_interleaved.interleave(np.asarray(m.data), out)
    return InterleavedQ4(out, m.cols)


def interleaved_matmul(p: InterleavedQ4, x: np.ndarray) -> np.ndarray:
    """``x [T, cols] @ W.T`` as float32 ``[T, rows]`` for any number of tokens; x is encoded as q8_0, as
    ``matvec`` encodes it."""
    backend = _backend()
    if isinstance(backend, str) or backend[1].interleaved is None:
        return p.matmul(x)
    from powerinfer_tools.kernels import numba_interleaved  # compiled on first use, as numba_kernels

    nk, ggml = backend
    x = _checked_input(x, p.cols, "x")
    q4_0, routines = ggml.routines[p.qtype], ggml.interleaved
    out = np.empty((x.shape[0], p.rows), dtype=np.float32)
    x_encoded = np.empty((x.shape[0], q4_0.encoded_bytes(p.cols)), dtype=np.uint8)
    numba_interleaved.gemm(routines.gemm, routines.gemv, routines.quantize4, q4_0.from_float, p.data, x, x_encoded,
                           out, nk.use_threads(_threads))
    return out


def block_matmul(m: QuantMatrix, x: np.ndarray, rows: np.ndarray | None, sgemm: int) -> np.ndarray:
    """``matvec``'s product for a block of tokens: dequantized rows times x through ``sgemm`` (the address of
    OpenBLAS's ILP64 ``cblas_sgemm``, kept single-threaded by the caller) on the kernels' threads
    (``numba_blocks``); exact up to float32 summation order, as the reference."""
    from powerinfer_tools.kernels import numba_blocks

    x, rows = _checked_input(x, m.cols, "x"), _checked_rows(m, rows)
    out = np.empty((x.shape[0], len(rows)), dtype=np.float32)
    numba_blocks.products(_to_float(m), sgemm, weight_bytes(m), rows, x, _block_buffers(m.cols), out, False)
    return out


def block_row_sum(m: QuantMatrix, coeffs: np.ndarray, rows: np.ndarray | None, sgemm: int) -> np.ndarray:
    """``row_axpy``'s product for a block of tokens, as ``block_matmul``: each thread's rows into its own
    partial sum, added up here."""
    from powerinfer_tools.kernels import numba_blocks

    rows = _checked_rows(m, rows)
    coeffs = _checked_input(coeffs, len(rows), "coeffs")
    buffers = _block_buffers(m.cols)
    partial = np.zeros((len(buffers), coeffs.shape[0], m.cols), dtype=np.float32)
    numba_blocks.products(_to_float(m), sgemm, weight_bytes(m), rows, coeffs, buffers, partial, True)
    return partial.sum(axis=0)


def bf16_row_sums(m: QuantMatrix) -> bool:
    """Whether ``bf16_row_sum`` takes ``m`` here: rows of a type that claims ``Kernel.BF16_ROW_SUM`` (q4_0), the
    compiled kernels in use, a CPU with AVX-512 BF16."""
    return WEIGHT_TYPES[m.qtype].has(Kernel.BF16_ROW_SUM) and _bf16_products()


def bf16_matmuls(m: QuantMatrix) -> bool:
    """Whether ``bf16_matmul`` takes ``m`` here: a type that claims ``Kernel.BF16_MATMUL`` (a quantized type,
    whose own rounding is far coarser than bfloat16's, or bf16 itself, which the products keep exactly; f32 and
    f16 matrices, kept in floats for their precision, stay with BLAS), rows of a multiple of 32 weights, the
    compiled kernels in use, a CPU with AVX-512 BF16."""
    return WEIGHT_TYPES[m.qtype].has(Kernel.BF16_MATMUL) and m.cols % 32 == 0 and _bf16_products()


def _bf16_products() -> bool:
    if not available():
        return False
    from powerinfer_tools.kernels import numba_bf16

    return numba_bf16.available()


def bf16_matmul(m: QuantMatrix, x: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
    """``matvec``'s product for a block of tokens (``bf16_matmuls``), both sides rounded to bfloat16 and summed in
    float32 (``numba_bf16.matmul``): each thread's rows dequantized a chunk at a time, as ``block_matmul``'s,
    but multiplied with ``vdpbf16ps`` instead of BLAS's float32."""
    from powerinfer_tools.kernels import numba_bf16

    x, rows = _checked_input(x, m.cols, "x"), _checked_rows(m, rows)
    threads = _backend()[0].use_threads(_threads)
    chunk = numba_bf16.chunk_rows(m.cols)
    out = np.empty((x.shape[0], len(rows)), dtype=np.float32)
    numba_bf16.matmul(_to_float(m), weight_bytes(m), rows, x, out, np.empty((threads, chunk, m.cols), np.float32),
                      np.empty((threads, chunk, m.cols), np.uint16),
                      np.empty((threads, numba_bf16.TOKENS, 32), dtype=np.float32))
    return out


def bf16_row_sum(m: QuantMatrix, coeffs: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
    """``row_axpy``'s product for a block of tokens over q4_0 rows (``bf16_row_sums``), both sides rounded to
    bfloat16 and summed in float32 (``numba_bf16``): a prompt's down projection over ``ffn_down_t`` without
    dequantizing it for BLAS, which takes several times as long (docs/lab/kernels.md, "A prompt's products in
    bfloat16")."""
    from powerinfer_tools.kernels import numba_bf16

    rows = _checked_rows(m, rows)
    coeffs = _checked_input(coeffs, len(rows), "coeffs")
    threads = _backend()[0].use_threads(_threads)
    out = np.empty((coeffs.shape[0], m.cols), dtype=np.float32)
    slabs = np.empty((threads, numba_bf16.slab_bytes(len(rows))), dtype=np.uint8)
    numba_bf16.row_sum(weight_bytes(m), rows, coeffs, out, slabs, np.empty((threads, numba_bf16.TOKENS, 32),
                                                                               dtype=np.float32))
    return out


def attention_takes(n_tokens: int, head_dim: int) -> bool:
    """Whether ``causal_attention`` computes a block of ``n_tokens`` queries of heads of ``head_dim`` here: the
    compiled kernels in use, heads it takes, and a block of at least ``ATTENTION_MIN_TOKENS`` (the kernel transposes
    every key first, for the tiles of a prompt: a batch's one token per sequence takes ``one_query_each``)."""
    if n_tokens < ATTENTION_MIN_TOKENS or not available():
        return False
    from powerinfer_tools.kernels import numba_attention

    return numba_attention.takes(head_dim)


def causal_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int, window: int | None,
                     scale: float, softcap: float | None = None) -> np.ndarray:
    """``models.layers.attention(q, keys, values, start, window, scale, softcap)`` (its scale given), compiled
    (``numba_attention``; ``attention_takes``): float32 ``[T, heads · hd]``, equal up to summation order."""
    from powerinfer_tools.kernels import numba_attention

    n_tokens, n_heads, head_dim = q.shape
    n_keys, n_kv = keys.shape[:2]
    # The kernel trusts shapes (a mismatch would read past the buffers), so check here.
    if keys.shape != values.shape or keys.shape[2] != head_dim or n_heads % n_kv or n_keys != start + n_tokens:
        raise ValueError(f"attention of q {q.shape} at {start} over keys {keys.shape}, values {values.shape}")
    out = np.empty((n_tokens, n_heads * head_dim), dtype=np.float32)
    threads = _backend()[0].use_threads(_threads)
    numba_attention.causal_attention(*(np.ascontiguousarray(a, dtype=np.float32) for a in (q, keys, values)), start,
                                     window or 0, np.float32(scale), np.float32(softcap or 0),
                                     *numba_attention.scratch(n_tokens, n_heads, n_keys, n_kv, head_dim, threads), out)
    return out


def one_query_each(q: np.ndarray, stored: list[tuple[np.ndarray, np.ndarray]], window: int | None,
                   scale: float, softcap: float | None = None) -> np.ndarray:
    """``models.layers.attention_each(q, stored, window, scale, softcap)`` (its scale given), compiled
    (``numba_attention.one_query_each``; the compiled kernels in use): float32 ``[B, heads · hd]``, equal up to
    summation order."""
    from powerinfer_tools.kernels import numba_attention

    n_sequences, n_heads, head_dim = q.shape
    keys = [np.ascontiguousarray(k, dtype=np.float32) for k, _ in stored]  # (a cache's rows are: no copy)
    values = [np.ascontiguousarray(v, dtype=np.float32) for _, v in stored]
    n_kv = keys[0].shape[1] if keys else 0
    # The kernel reads the caches through their addresses, trusting these shapes: check them here.
    if (len(stored) != n_sequences or n_kv == 0 or n_heads % n_kv
            or any(k.shape != v.shape or not len(k) or k.shape[1:] != (n_kv, head_dim) for k, v in zip(keys, values))):
        raise ValueError(f"one query each of q {q.shape} over keys {[k.shape for k in keys]}, "
                         f"values {[v.shape for v in values]}")
    lengths = np.array([len(k) for k in keys], dtype=np.int64)
    firsts = np.maximum(lengths - window, 0) if window else np.zeros_like(lengths)
    out = np.empty((n_sequences, n_heads * head_dim), dtype=np.float32)
    _backend()[0].use_threads(_threads)
    numba_attention.one_query_each(np.ascontiguousarray(q, dtype=np.float32),
                                   np.array([k.ctypes.data for k in keys], dtype=np.int64),
                                   np.array([v.ctypes.data for v in values], dtype=np.int64), lengths, firsts, n_kv,
                                   np.float32(scale), np.float32(softcap or 0),
                                   numba_attention.each_scratch(n_sequences, n_heads, lengths.max()), out)
    return out


_BLOCK_BUFFER_BYTES = 2 << 20  # a thread's float32 chunk of dequantized rows: in L2/L3 while BLAS reads it


def _block_buffers(cols: int) -> np.ndarray:
    """float32 ``[threads, chunk, cols]``: each of the kernels' threads' chunk of dequantized rows (the compiled
    kernels in use: ``available()``)."""
    threads = _backend()[0].use_threads(_threads)
    chunk = max(16, min(512, _BLOCK_BUFFER_BYTES // (4 * cols)))
    return np.empty((threads, chunk, cols), dtype=np.float32)


def _to_float(m: QuantMatrix) -> int:
    """ggml's ``to_float`` for ``m``'s type, or 0 for f32 (its rows are copied as they are)."""
    from powerinfer_tools.kernels import ggml_base

    return ggml_base.loaded().to_float.get(m.qtype, 0)


def axpy_output(n_tokens: int, cols: int) -> np.ndarray:
    """Zeroed float32 ``[n_tokens, cols]`` for an axpy to add into, its rows one cache line further apart
    than their width: an axpy adds each weight block to many tokens' rows at once, and rows a multiple
    of 4 KiB apart share their L1 sets and evict each other (the prompt's down projection over TinyLlama's
    ``ffn_down_t``, whose rows are 8 KiB, took several times as long unpadded)."""
    return np.zeros((n_tokens, cols + 16), dtype=np.float32)[:, :cols]


@functools.cache
def _backend():
    """``(numba_kernels module, checked GgmlCpu)``, or the reason string when they cannot load or are not
    to be used."""
    if _reference_reason is not None:
        return _reference_reason
    try:
        from powerinfer_tools.kernels import numba_kernels
    except ImportError as exc:
        return f"numba is not installed ({exc})"
    try:
        ggml = ggml_ops.load()
        from powerinfer_tools.kernels import numba_kquants

        return numba_kernels, ggml.with_vec_dots(numba_kquants.vec_dot_addresses(), numba_kquants.__name__)
    except ggml_ops.GgmlUnavailable as exc:
        return str(exc)


def _compiled_or_none(n_tokens: int):
    """``(numba_kernels, GgmlCpu, threads in use)`` when the compiled path should run, else None."""
    backend = _backend()
    if isinstance(backend, str):
        if not reference_chosen():  # a choice is announced by whoever made it
            _warn_fallback(backend)
        return None
    if n_tokens > MAX_TOKENS:
        return None
    nk, ggml = backend
    return nk, ggml, nk.use_threads(_threads)


@functools.cache
def _warn_fallback(reason: str) -> None:
    warnings.warn(f"compiled CPU kernels unavailable, using NumPy: {reason}", RuntimeWarning, stacklevel=4)


def _checked_input(a: np.ndarray, width: int, name: str) -> np.ndarray:
    # The kernels trust shapes (a mismatch would read past the buffers), so check here.
    if a.ndim != 2 or a.shape[1] != width:
        raise ValueError(f"{name} must be [T, {width}], got shape {a.shape}")
    return np.ascontiguousarray(a, dtype=np.float32)


def _checked_rows(m: QuantMatrix, rows: np.ndarray | None) -> np.ndarray:
    if rows is None:
        return np.arange(m.rows, dtype=np.intp)
    rows = np.ascontiguousarray(rows, dtype=np.intp)  # one integer type: one compiled specialization
    if rows.ndim != 1:
        raise ValueError(f"rows must be 1-D, got shape {rows.shape}")
    if rows.size and (rows.min() < 0 or rows.max() >= m.rows):
        raise IndexError(f"row indices must lie in [0, {m.rows}), got {rows.min()}..{rows.max()}")
    return rows


def weight_bytes(m: QuantMatrix) -> np.ndarray:
    """``m.data`` as a read-only C-contiguous uint8 ``[rows, row_bytes]`` view (a copy only if it is not
    contiguous): always the same array type, so each kernel is compiled (and cached) once, whether the
    weights are a read-only np.memmap or a writable array."""
    view = np.ascontiguousarray(np.asarray(m.data)).view(np.uint8)
    view.flags.writeable = False
    return view
