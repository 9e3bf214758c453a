"""Time the compiled CPU kernels against the NumPy reference on FFN-shaped matrices.

    python examples/bench_kernels.py [--repeats 40] [--ref-repeats 7] [--pool-mb 1024]
                                     [--shapes tinyllama,llama7b] [--only-interleaved | --only-vnni |
                                      --only-decoder-axpy | --only-prompt-bf16 | --only-tokens]

For TinyLlama (gate/up 5632x2048) and LLaMA-7B (11008x4096) shapes, q4_0 and q8_0, all rows and a
random 10%, 1 and 2 threads, it times ``matvec`` (gate/up) and ``row_axpy`` (``ffn_down_t``, the same
shape) for one token. It prints the median GB/s of weight bytes touched (bracketed: the GB/s of the
fastest tenth of calls, since on a busy machine the median includes other processes' time slices),
the reference's median GB/s, and the ratio of medians over ``QuantMatrix.matmul`` /
``weighted_row_sum``. Each call reads a different copy of the matrix (a pool of ``--pool-mb``) and
a fresh random row set, so weights come from memory rather than cache, as they do when a model
decodes; a NumPy streaming read of the same pool gives the machine's memory speed at that moment.
A table times T = 1..256 tokens, to find where the reference's dequantize + BLAS overtakes
the kernels (``--only-tokens`` alone; with ``PYTHONPATH`` set to another checkout it compares two
versions of the kernels for a batch's or a short prompt's tokens). The reference's BLAS uses its own
thread count throughout. The last table compares, for
a dense q4_0 matrix, ggml's products over rows interleaved eight at a time (``kernels.interleaved``)
with ``matvec`` (one token: ``vec_dot`` row by row, or ``numba_vnni.row_dot`` on a CPU with AVX-512
VNNI) and with the runtime's prompt path, dequantize + BLAS shared out to the kernel threads
(``runtime.backends._BlockProducts``). Where the CPU has AVX-512 VNNI, a last table times one token
from memory through ggml's products and through ``numba_vnni``'s: scattered q4_0 rows (10%, 22%, all),
the same matrix interleaved and used whole, and a q8_0 output head (32000 x 2048).
``--only-decoder-axpy`` times the one-token axpy the compiled decoder runs over ``ffn_down_t``
(``numba_kernels.axpy_rows_one_token``: the threads share the rows), at 10, 30 and 75% of the rows; run it
with ``PYTHONPATH`` set to another checkout to compare two versions of the kernel. ``--only-prompt-bf16`` times
a prompt's products that have no GEMM of ggml's here (64 and 128 tokens): the down projection over every q4_0
row of ``ffn_down_t``, and q4_K, q6_K and q5_0 matrices, dequantized for BLAS against bfloat16 products
(``kernels.bf16_row_sum`` / ``bf16_matmul``, CPUs with AVX-512 BF16), the two called in turn.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from numba import njit, prange
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from powerinfer_tools import kernels
from powerinfer_tools.kernels import numba_kernels as nk
from powerinfer_tools.kernels.interleaved import interleave
from powerinfer_tools.kernels.quant import QuantMatrix
from powerinfer_tools.runtime.backends import CpuBackend

SHAPES = {"tinyllama": (5632, 2048), "llama7b": (11008, 4096), "smollm2": (1536, 576)}
NARROW = {"smollm2"}  # widths that are not whole groups of the VNNI and streaming tables: the axpy table only


def random_matrix(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> QuantMatrix:
    """Random quantized rows with sane f16 scales; only speed is measured, so no quantizer is needed."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block, block_bytes), dtype=np.uint8)
    data[:, :, :2] = np.full((rows, cols // block), 0.01, np.float16).view(np.uint8).reshape(rows, -1, 2)
    data = data.reshape(rows, -1)
    data.setflags(write=False)  # as a read-only GGUF memory map is
    return QuantMatrix(qtype, data)


def matrix_pool(qtype: Q, rows: int, cols: int, pool_mb: int, rng: np.random.Generator) -> list[QuantMatrix]:
    """Copies of a random matrix filling ``pool_mb`` (one at least): cycled through, so weights come from memory."""
    first = random_matrix(qtype, rows, cols, rng)
    copies = max(0, pool_mb * 2**20 // first.nbytes - 1)
    return [first] + [random_matrix(qtype, rows, cols, rng) for _ in range(copies)]


def seconds(call, pool: list[QuantMatrix], inputs: list, repeats: int) -> np.ndarray:
    """Wall time of ``repeats`` calls, cycling through the pool and the inputs."""
    call(pool[0], inputs[0])  # compile or load the cached machine code outside the timing
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        call(pool[i % len(pool)], inputs[i % len(inputs)])
        times.append(time.perf_counter() - start)
    return np.array(times)


def row_sets(n_rows: int, density: float, count: int, rng: np.random.Generator) -> list:
    if density == 1.0:
        return [None]
    return [np.sort(rng.choice(n_rows, int(n_rows * density), replace=False)) for _ in range(count)]


def gbps(nbytes: int, times: np.ndarray) -> str:
    """Median GB/s, and in brackets the GB/s of the fastest tenth of calls (the least disturbed)."""
    return f"{nbytes / np.median(times) / 1e9:5.1f} ({nbytes / np.percentile(times, 10) / 1e9:4.1f})"


def bench_shapes(args, rng):
    print(f"{'shape':>9} {'type':>4} {'rows':>4} {'thr':>3} | {'matvec GB/s':>12} {'ref':>5} {'ratio':>6} "
          f"| {'axpy GB/s':>12} {'ref':>5} {'ratio':>6}")
    for shape in args.shapes.split(","):
        n_rows, n_cols = SHAPES[shape]
        for qtype in (Q.Q4_0, Q.Q8_0):
            pool = matrix_pool(qtype, n_rows, n_cols, args.pool_mb, rng)
            first = pool[0]
            stream = seconds(lambda m, _: np.bitwise_or.reduce(m.data.view(np.uint64), axis=None), pool, [0],
                             args.repeats)
            print(f"{shape:>9} {qtype.name:>4} streaming read of the weights by NumPy, 1 thread: "
                  f"{gbps(first.nbytes, stream)} GB/s")
            x = rng.standard_normal((1, n_cols), dtype=np.float32)
            for density in (1.0, 0.1):
                rows = row_sets(n_rows, density, args.repeats, rng)
                k = int(n_rows * density)
                coeffs = rng.standard_normal((1, k), dtype=np.float32)
                nbytes = k * first.row_bytes
                mv_inputs = [(x, r) for r in rows]
                ax_inputs = [(coeffs, r) for r in rows]
                # the reference's speed does not depend on set_threads: its BLAS has its own threads
                mv_ref = seconds(lambda m, a: m.matmul(*a), pool, mv_inputs, args.ref_repeats)
                ax_ref = seconds(lambda m, a: m.weighted_row_sum(*a), pool, ax_inputs, args.ref_repeats)
                for threads in (1, 2):
                    kernels.set_threads(threads)
                    mv = seconds(lambda m, a: kernels.matvec(m, *a), pool, mv_inputs, args.repeats)
                    ax = seconds(lambda m, a: kernels.row_axpy(m, *a), pool, ax_inputs, args.repeats)
                    print(f"{shape:>9} {qtype.name:>4} {density:>4.0%} {threads:>3} | {gbps(nbytes, mv)} "
                          f"{nbytes / np.median(mv_ref) / 1e9:5.2f} {np.median(mv_ref) / np.median(mv):5.0f}x | "
                          f"{gbps(nbytes, ax)} {nbytes / np.median(ax_ref) / 1e9:5.2f} "
                          f"{np.median(ax_ref) / np.median(ax):5.0f}x")


def bench_tokens(args, rng):
    """Dense q4_0 TinyLlama shape from memory (the pool), 2 threads: kernel time against reference time as T grows."""
    n_rows, n_cols = SHAPES["tinyllama"]
    pool = matrix_pool(Q.Q4_0, n_rows, n_cols, args.pool_mb, rng)
    kernels.set_threads(2)
    kernels.MAX_TOKENS = 1 << 30  # take the compiled path at every T, to see where the line belongs
    print("\ncrossover, tinyllama q4_0, all rows, from memory, 2 threads: median ms, kernel / reference")
    for tokens in (1, 2, 4, 8, 16, 32, 64, 256):
        x = [(rng.standard_normal((tokens, n_cols), dtype=np.float32), None)]
        coeffs = [(rng.standard_normal((tokens, n_rows), dtype=np.float32), None)]
        times = [np.median(seconds(call, pool, inputs, repeats)) * 1e3 for call, inputs, repeats in (
            (lambda m, a: kernels.matvec(m, *a), x, args.repeats), (lambda m, a: m.matmul(*a), x, args.ref_repeats),
            (lambda m, a: kernels.row_axpy(m, *a), coeffs, args.repeats),
            (lambda m, a: m.weighted_row_sum(*a), coeffs, args.ref_repeats),
        )]
        print("T={:>3}: matvec {:7.2f} / {:7.2f}   axpy {:7.2f} / {:7.2f}".format(tokens, *times))


def bench_interleaved(args, rng):
    """Dense q4_0, from memory (the pool) and from cache (one matrix): interleaved against as stored."""
    if kernels.ggml_routines().interleaved is None:
        print("\nggml's interleaved q4_0 kernels do not run on this CPU")
        return
    blocks = CpuBackend()._blocks
    print("\ninterleaved q4_0 (ggml gemv/gemm) against vec_dot row by row (T=1) and dequantize + BLAS (T>32): "
          "median ms, as stored / interleaved")
    for shape in args.shapes.split(","):
        n_rows, n_cols = SHAPES[shape]
        pool = matrix_pool(Q.Q4_0, n_rows, n_cols, args.pool_mb, rng)
        packed = {id(m): interleave(m) for m in pool}
        for threads in (1, 2):
            kernels.set_threads(threads)
            for tokens in (1, 64, 128):
                x = [rng.standard_normal((tokens, n_cols), dtype=np.float32)]
                stored = (lambda m, a: kernels.matvec(m, a)) if tokens == 1 else (lambda m, a: blocks.matmul(m, a))
                line = []
                for name, matrices in (("memory", pool), ("cache", pool[:1])):
                    a = np.median(seconds(stored, matrices, x, args.repeats))
                    b = np.median(seconds(lambda m, v: kernels.interleaved_matmul(packed[id(m)], v), matrices, x,
                                          args.repeats))
                    line.append(f"{name} {a * 1e3:7.2f} / {b * 1e3:7.2f} ({a / b:4.2f}x)")
                print(f"{shape:>9} T={tokens:>3} {threads} thr: " + "   ".join(line))


@njit(parallel=True, nogil=True)
def _read_rows(weights, rows, out):
    """Only read the rows (every 8-byte word, prefetching two rows ahead): the memory's ceiling for a kernel."""
    n, data = rows.shape[0], weights.view(np.uint64)
    for i in prange(n):
        if i + 2 < n:
            nk.prefetch_span(weights.ctypes.data + rows[i + 2] * weights.strides[0], weights.shape[1],
                             nk.in_order(rows))
        acc = np.uint64(0)
        for word in data[rows[i]]:
            acc ^= word
        out[i] = acc


def bench_vnni(args, rng):
    """One token from memory, 1 and 2 threads: ggml's products against ``numba_vnni``'s (AVX-512 VNNI)."""
    from powerinfer_tools.kernels import numba_interleaved, numba_vnni

    if not numba_vnni.available():
        print("\nAVX-512 VNNI products: this CPU lacks AVX-512 VNNI/VBMI")
        return
    ggml = kernels.ggml_routines()
    print("\none token from memory, GB/s of weights: ggml's vec_dot row by row / numba_vnni.row_dot (scattered "
          "rows) [only reading the rows], ggml's gemv / numba_vnni.interleaved_group (interleaved, whole)")
    for shape, qtype in [(s, Q.Q4_0) for s in args.shapes.split(",")] + [("head", Q.Q8_0)]:
        n_rows, n_cols = SHAPES[shape] if shape in SHAPES else (32000, 2048)
        pool = matrix_pool(qtype, n_rows, n_cols, args.pool_mb, rng)
        first = pool[0]
        routine = ggml.routines[qtype]
        x = rng.standard_normal(n_cols, dtype=np.float32)
        x_q8_0 = np.empty(routine.encoded_bytes(n_cols), np.uint8)
        scratch = np.empty(numba_vnni.encoded_bytes(int(qtype), n_cols), np.uint8)
        for threads in (1, 2):
            kernels.set_threads(threads)
            nk.use_threads(threads)
            for density in (0.1, 0.22, 1.0):
                rows = row_sets(n_rows, density, args.repeats, rng)
                rows = [np.arange(n_rows) if r is None else r.astype(np.intp) for r in rows]
                out = np.empty(len(rows[0]), np.float32)
                inputs = list(rows)
                a = seconds(lambda m, r: nk.dot_rows(routine.from_float, routine.vec_dot, m.data, r, x[None],
                                                     x_q8_0[None], out[None]), pool, inputs, args.repeats)
                b = seconds(lambda m, r: numba_vnni.dot_rows(int(qtype), routine.from_float, m.data, r, x[None],
                                                             x_q8_0[None], scratch[None], out[None]), pool, inputs,
                            args.repeats)
                words = np.empty(len(rows[0]), np.uint64)
                c = seconds(lambda m, r: _read_rows(m.data, r, words), pool, inputs, args.repeats)
                nbytes = len(rows[0]) * first.row_bytes
                print(f"{shape:>9} {qtype.name} {density:>4.0%} {threads} thr: rows {gbps(nbytes, a)} / "
                      f"{gbps(nbytes, b)} ({np.median(a) / np.median(b):4.2f}x) [{gbps(nbytes, c)}]")
            if qtype is Q.Q4_0 and ggml.interleaved is not None:
                packed = {id(m): interleave(m).data for m in pool}
                out = np.empty(n_rows, np.float32)
                encoded = x_q8_0[None]
                a, b = (seconds(lambda m, _: numba_interleaved.gemv(ggml.interleaved.gemv, packed[id(m)], encoded,
                                                                      n_cols, out, threads, vnni), pool, [0],
                                args.repeats) for vnni in (False, True))
                print(f"{shape:>9} {qtype.name} whole {threads} thr: interleaved {gbps(first.nbytes, a)} / "
                      f"{gbps(first.nbytes, b)} ({np.median(a) / np.median(b):4.2f}x)")


def bench_decoder_axpy(args, rng):
    """The compiled decoder's one-token axpy over scattered rows, from memory (the pool)."""
    print("\none token's axpy over ffn_down_t rows (axpy_rows_one_token), from memory: GB/s of rows read")
    for shape in args.shapes.split(","):
        n_rows, n_cols = SHAPES[shape]
        for qtype in (Q.Q4_0, Q.Q8_0):
            pool = matrix_pool(qtype, n_rows, n_cols, args.pool_mb, rng)
            first = pool[0]
            for density in (0.1, 0.3, 0.75):
                rows = [r.astype(np.intp) for r in row_sets(n_rows, density, args.repeats, rng)]
                coeffs = rng.standard_normal((1, len(rows[0])), dtype=np.float32)
                out = np.zeros((1, n_cols), np.float32)
                for threads in (1, 2):
                    times = seconds(lambda m, r: nk.axpy_rows_one_token(int(qtype), m.data, r, coeffs, out, threads),
                                    pool, rows, args.repeats)
                    print(f"{shape:>9} {qtype.name} {density:>4.0%} {threads} thr: "
                          f"{gbps(len(rows[0]) * first.row_bytes, times)} GB/s, {np.median(times) * 1e6:7.1f} us")


def _in_turn(ways, pool: list[QuantMatrix], repeats: int) -> np.ndarray:
    """Median seconds of each of ``ways`` (functions of a matrix), called in turn, each call on its own matrix of
    the pool (from memory)."""
    for way in ways:
        way(pool[0])  # compile or load the cached machine code outside the timing
    times = np.zeros((repeats, len(ways)))
    for i in range(repeats):
        for k, way in enumerate(ways):
            m = pool[(len(ways) * i + k) % len(pool)]
            start = time.perf_counter()
            way(m)
            times[i, k] = time.perf_counter() - start
    return np.median(times, axis=0)


def bench_prompt_bf16(args, rng):
    """A prompt's products without a GEMM of ggml's here, from memory: dequantized for BLAS (``_BlockProducts``)
    against bfloat16 products: the down projection over every q4_0 row of ``ffn_down_t`` (``kernels.bf16_row_sum``)
    and gate-shaped k-quant and q5_0 matrices (``kernels.bf16_matmul``)."""
    blocks = CpuBackend()._blocks
    if not kernels.bf16_matmuls(random_matrix(Q.Q4_0, 8, 32, rng)):
        print("\nthis CPU lacks AVX-512 BF16: a prompt's products take BLAS")
        return
    print("\na prompt's products from memory, median ms, dequantize + BLAS / bfloat16 (ffn_down_t: coeffs @ W; "
          "others: x @ W.T, W [rows, cols] as a gate is)")
    for shape in args.shapes.split(","):
        n_rows, n_cols = SHAPES[shape]
        for qtype in (Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.Q5_0):
            if n_cols % GGML_QUANT_SIZES[qtype][0]:
                continue  # SmolLM2's 576 columns are no whole number of k-quant blocks
            pool = matrix_pool(qtype, n_rows, n_cols, args.pool_mb, rng)
            for threads, tokens in ((1, 128), (2, 64), (2, 128)):
                kernels.set_threads(threads)
                if qtype == Q.Q4_0:
                    a = rng.standard_normal((tokens, n_rows), dtype=np.float32)
                    what = "ffn_down_t"
                    ways = (lambda m: blocks.row_sum(m, a), lambda m: kernels.bf16_row_sum(m, a, None))
                else:
                    a = rng.standard_normal((tokens, n_cols), dtype=np.float32)
                    what = "rows"
                    ways = (lambda m: blocks.matmul(m, a), lambda m: kernels.bf16_matmul(m, a, None))
                blas, bf16 = _in_turn(ways, pool, args.repeats) * 1e3
                print(f"{shape:>9} {qtype.name:>4} {what:>10} T={tokens:>3} {threads} thr: {blas:7.2f} / {bf16:7.2f} "
                      f"({blas / bf16:4.2f}x)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40, help="timed calls per kernel measurement")
    parser.add_argument("--ref-repeats", type=int, default=7, help="timed calls per reference measurement")
    parser.add_argument("--pool-mb", type=int, default=1024, help="weights cycled through, to defeat the caches")
    parser.add_argument("--shapes", default="tinyllama,llama7b")
    parser.add_argument("--only-interleaved", action="store_true", help="just the interleaved table")
    parser.add_argument("--only-vnni", action="store_true", help="just the AVX-512 VNNI table")
    parser.add_argument("--only-decoder-axpy", action="store_true", help="just the one-token axpy table")
    parser.add_argument("--only-tokens", action="store_true", help="just the crossover table (kernels by token count)")
    parser.add_argument("--only-prompt-bf16", action="store_true", help="just the prompt products' bfloat16 table")
    args = parser.parse_args()
    narrow = NARROW & set(args.shapes.split(","))
    if narrow and not (args.only_decoder_axpy or args.only_prompt_bf16):
        parser.error(f"--shapes {','.join(sorted(narrow))}: for --only-decoder-axpy only: its 576-column rows are "
                     "not whole 8-byte words and 128-column groups, as the other tables read rows")
    if not kernels.available():
        raise SystemExit(f"compiled kernels unavailable: {kernels.unavailable_reason()}")
    print(kernels.describe())
    rng = np.random.default_rng(0)
    if args.only_decoder_axpy:
        bench_decoder_axpy(args, rng)
        return
    if args.only_prompt_bf16:
        bench_prompt_bf16(args, rng)
        return
    if args.only_tokens:
        bench_tokens(args, rng)
        return
    if not (args.only_interleaved or args.only_vnni):
        bench_shapes(args, rng)
        bench_tokens(args, rng)
    if not args.only_vnni:
        bench_interleaved(args, rng)
    if not args.only_interleaved:
        bench_vnni(args, rng)


if __name__ == "__main__":
    main()
