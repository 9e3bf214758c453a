"""Where a decoded token's time goes on the compiled one-token path, part by part, and what each part reads.

    python examples/decode_breakdown.py MODEL.gguf [--mode sparse|dense] [--threads 2] [--repeats 30]

After a 99-token prompt it times, for every layer in turn, the three calls a layer makes
(``runtime/compiled_decode.py``, ``ffn_decode.py``): ``decode_chosen`` (the attention, then ``choose``: what
chooses the neurons, the predictor or CATS's selection, and the products the layer's plan computes whole: CATS's
gate, matrices the loader interleaved), the chosen neurons' activations (from their gate and up rows, or from
those whole products), and the down projection (with TEAL's selection where the file has it); then the output
head, and whole steps for
comparison. Medians per layer, times the layer count. Layers are timed on the model's own weights in memory
order, so the weights come from memory as in a real step, and the residual flows through them from a token's
embedding, so that each layer chooses the neurons a real token's does (the KV cache position is held fixed).
For mixtures of experts and ``--ram`` it is not meant.

Beside each part: the weight bytes it reads (by type) and the rate that makes, against the memory bandwidth
``pitools probe`` measures (``--bandwidth`` to give it instead). Then what arithmetic alone allows: each weight
type's rows multiplied with one token on data in cache (the first rows of the model's first matrix of that type,
``--in-cache-kib`` of them a thread, over and over), on one thread and on ``--threads``, through the same
``vec_dot`` the decoder calls. A part whose rate from memory is near its type's rate in cache is bound by its arithmetic, not by
memory.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from numba import njit

from powerinfer_tools import kernels
from powerinfer_tools.benchmarking.bench import measure_bandwidth
from powerinfer_tools.formats.weight_types import WEIGHT_TYPES
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.kernels import kernel_thread
from powerinfer_tools.kernels import numba_kernels as nk
from powerinfer_tools.kernels.quant import QuantMatrix
from powerinfer_tools.models.layers import embedding_scale
from powerinfer_tools.runtime import compiled_decode as cd
from powerinfer_tools.runtime import ffn_decode as fd
from powerinfer_tools.runtime.loader import load_runtime_model


TOKEN = 5  # the token fed to the layers (and to the whole steps timed for comparison)


@njit
def _encode(from_float, x, out):
    nk.ggml_from_float(from_float, x.ctypes.data, out.ctypes.data, x.shape[0])


@njit
def _attention(x, w, s, keys, values, pos, cos, sin, n_heads, eps, fns, n_threads):
    return cd.decode_chosen(x, w, s, keys, values, pos, 0, cos, sin, n_heads, eps, fns, n_threads)


@njit
def _gate_up(w, s, n, fns):
    return fd.activations(w, s, n, fns).copy()


@njit
def _down(x, w, s, rows, fns, n_threads):
    return fd.down_of_activations(x, w, s, rows, fns, n_threads)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--mode", default="sparse", choices=["sparse", "dense"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--bandwidth", type=float, help="memory bandwidth in GB/s (default: measure it now)")
    parser.add_argument("--in-cache-kib", type=int, default=512, help="rows timed in cache, KiB a thread")
    args = parser.parse_args()
    kernels.set_threads(args.threads)
    model = load_runtime_model(args.model, cpu_only=True)
    model.mode = FFNMode(args.mode)
    caches = model.new_cache()
    model.forward(np.arange(1, 100) * 7 % 1000, caches, all_logits=False)
    decoder, spec = model.compiled_decoder(), model.spec
    if decoder is None or spec.moe or not decoder.usable(model.mode, 1, caches):
        raise SystemExit(f"{args.model}: its steps do not take the compiled one-token path this script times")
    embedded = model.token_embd.dequantize_rows(np.array([TOKEN]))[0]
    bandwidth = args.bandwidth or measure_bandwidth(args.threads)
    # Timed on the kernel thread, as a step runs: a second Python thread running the kernels would start a second
    # team of threads, and both would slow (kernels/kernel_thread.py)
    times = kernel_thread.call(_time_layers, decoder, model.mode, spec, caches,
                               embedded * np.float32(embedding_scale(spec) or 1.0), args)
    neurons, down_rows = np.mean(times.pop("neurons"), axis=0)
    share = neurons / spec.d_ff, down_rows / spec.d_ff  # of the gate/up rows and of the down rows read
    parts = _part_matrices(model)
    read = {"attention (+ choosing the neurons)": _bytes(parts["attention"]),
            "gate/up of the chosen neurons": _bytes(parts["gate/up"], share[0]),
            "down projection": _bytes(parts["down"], share[1])}
    print(f"memory bandwidth (pitools probe): {bandwidth:.1f} GB/s; {args.threads} threads")
    total = 0.0
    for name, values in times.items():
        seconds = float(np.median(values)) * spec.n_layers
        total += seconds
        _print_part(name, seconds, read[name], bandwidth, f"{np.median(values) * 1e3:6.3f} ms a layer")
    print(f"{'neurons computed / down rows read':>34}: {neurons:.1f} / {down_rows:.1f} of {spec.d_ff}")
    x = np.random.default_rng(1).standard_normal((1, spec.d_model)).astype(np.float32)
    head = kernel_thread.call(_median_seconds, lambda: model.head_backend.matmul(model.output, x), args.repeats)
    total += head
    _print_part("output head", head, _bytes([model.output]), bandwidth, type(model.output).__name__)
    step = _median_seconds(lambda: model.forward(np.array([TOKEN]), caches, all_logits=False), args.repeats)
    print(f"{'whole step':>34}: {step * 1e3:6.1f} ms (the parts: {total * 1e3:.1f} ms)")
    print(f"rows times one token in cache ({args.in_cache_kib} KiB of rows a thread, the decoder's vec_dot):")
    for matrix in {m.qtype: m for ms in parts.values() for m in ms if isinstance(m, QuantMatrix)}.values():
        rates = [kernel_thread.call(_in_cache_rate, matrix, decoder.fns, n * args.in_cache_kib << 10, n)
                 for n in (1, args.threads)]
        print(f"{WEIGHT_TYPES[matrix.qtype].name:>34}: {rates[0]:5.1f} GB/s on 1 thread, {rates[1]:5.1f} on "
              f"{args.threads} ({kernels.vec_dot_name(matrix.qtype)})")


def _part_matrices(model) -> dict[str, list]:
    """Every layer's matrices of each part a decoded token reads (a layer's own FFN, one partition)."""
    layers = [(layer.dense, layer.partitions[0]) for layer in model.layers]
    return {"attention": [m for a, _ in layers for m in (a.wq, a.wk, a.wv, a.wo)],
            "gate/up": [m for _, p in layers for m in (p.gate, p.up)],
            "down": [p.down if p.down is not None else p.down_t for _, p in layers]}


def _bytes(matrices, share: float = 1.0) -> dict[str, float]:
    """The bytes of ``matrices`` (``share`` of each read) by weight type."""
    by_type: dict[str, float] = {}
    for m in matrices:
        name = WEIGHT_TYPES[m.qtype].name
        by_type[name] = by_type.get(name, 0.0) + np.asarray(m.data).nbytes * share
    return by_type


def _print_part(name: str, seconds: float, read: dict[str, float], bandwidth: float, detail: str) -> None:
    total = sum(read.values())
    types = ", ".join(f"{t} {b / 1e6:.1f}" for t, b in read.items())
    print(f"{name:>34}: {seconds * 1e3:6.1f} ms a token ({detail}); reads {total / 1e6:6.1f} MB ({types}): "
          f"{total / seconds / 1e9:5.1f} GB/s, {total / seconds / 1e9 / bandwidth:4.0%} of the probe")


def _in_cache_rate(matrix: QuantMatrix, fns: np.ndarray, nbytes: int, threads: int) -> float:
    """GB/s of ``matrix``'s first rows (``nbytes`` of them) times one token, on data in cache."""
    rows = np.asarray(matrix.data)[: max(1, nbytes // matrix.row_bytes)]
    x = np.random.default_rng(2).standard_normal(matrix.cols).astype(np.float32)
    encoded = np.empty(WEIGHT_TYPES[matrix.qtype].encoded_bytes(matrix.cols), np.uint8)
    _encode(fns[int(matrix.qtype), 0], x, encoded)
    out = np.empty(rows.shape[0], np.float32)
    nk.use_threads(threads)
    repeats = max(20, (200 << 20) // rows.nbytes)
    seconds = _median_seconds(lambda: [nk.matvec(fns[int(matrix.qtype), 1], rows, encoded, matrix.cols, out)
                                       for _ in range(repeats)], 5)
    return rows.nbytes * repeats / seconds / 1e9


def _time_layers(decoder, mode, spec, caches, embedded, args) -> dict[str, list]:
    threads = nk.use_threads(args.threads)
    s = decoder.scratch
    pos, half = caches[0].length, spec.head_dim // 2
    cos, sin = np.ones(half, np.float32), np.zeros(half, np.float32)
    empty = np.zeros((1, spec.n_kv_heads, spec.head_dim), np.float32)
    times = {"attention (+ choosing the neurons)": [], "gate/up of the chosen neurons": [], "down projection": [],
             "neurons": []}
    for repeat in range(args.repeats + 3):
        residual = embedded.copy()  # each layer's output is the next one's input, as in a step
        for (w, *_), cache in zip(decoder.steps[mode], caches):
            keys, values = cache.store(0, empty, empty)  # position pos, as a step would fill it
            start = time.perf_counter()
            n = _attention(residual, w, s, keys, values, pos, cos, sin, spec.n_heads, spec.norm_eps, decoder.fns,
                           threads)
            chosen = time.perf_counter()
            rows = _gate_up(w, s, n, decoder.fns)
            computed = time.perf_counter()
            m = _down(residual, w, s, rows, decoder.fns, threads)
            done = time.perf_counter()
            if repeat >= 3:  # the first ones compile or warm up
                for name, seconds in zip(list(times)[:3], (chosen - start, computed - chosen, done - computed)):
                    times[name].append(seconds)
                times["neurons"].append((n, m))
    return times


def _median_seconds(call, repeats: int) -> float:
    call()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds))


if __name__ == "__main__":
    main()
