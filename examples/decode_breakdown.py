"""Where a decoded token's time goes on the compiled one-token path, part by part.

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
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from numba import njit

from powerinfer_tools import kernels
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.kernels import numba_kernels as nk
from powerinfer_tools.models.layers import embedding_scale
from powerinfer_tools.runtime import compiled_decode as cd
from powerinfer_tools.runtime import ffn_decode as fd
from powerinfer_tools.runtime.loader import load_runtime_model


TOKEN = 5  # the token fed to the layers (and to the whole steps timed for comparison)


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
    times = _time_layers(decoder, model.mode, spec, caches, embedded * np.float32(embedding_scale(spec) or 1.0),
                         args)
    for name, values in times.items():
        if name != "neurons":
            print(f"{name:>34}: {np.median(values) * 1e3:6.3f} ms a layer, x{spec.n_layers} = "
                  f"{np.median(values) * 1e3 * spec.n_layers:6.1f} ms a token")
    print(f"{'neurons computed / down rows read':>34}: {np.mean(times['neurons'], axis=0).round(1)} of {spec.d_ff}")
    x = np.random.default_rng(1).standard_normal((1, spec.d_model)).astype(np.float32)
    head = _median_seconds(lambda: model.head_backend.matmul(model.output, x), args.repeats)
    print(f"{'output head':>34}: {head * 1e3:6.3f} ms ({type(model.output).__name__}, {model.output.qtype.name})")
    step = _median_seconds(lambda: model.forward(np.array([TOKEN]), caches, all_logits=False), args.repeats)
    print(f"{'whole step':>34}: {step * 1e3:6.1f} ms")


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
