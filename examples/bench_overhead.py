"""How much of a decoded token is Python and dispatch rather than memory traffic (issue 7, point 3).

Method: a "skeleton" model with the layer count and structure of the model under test but tiny
matrices (d_model 64, d_ff 256) does the same Python work, kernel calls and thread-pool fork/joins
per token while its arithmetic and memory traffic are negligible, so its time per token is the
fixed overhead. Divided by the real model's time per token, it is the overhead's share. Both are
timed in the same process, alternating, for the compiled one-token path (``runtime/compiled_decode.py``)
and for the general path it replaces (``RuntimeModel._layer``).

    OMP_WAIT_POLICY=passive python examples/bench_overhead.py /tmp/pi-bench/tinyllama-1.1b.powerinfer.gguf
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # before numba's OpenMP runtime loads

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from powerinfer_tools import kernels  # noqa: E402
from powerinfer_tools.benchmarking.synth import Planting, Shape, synthesize  # noqa: E402
from powerinfer_tools.interfaces import FFNMode  # noqa: E402
from powerinfer_tools.predictors.trainer import TrainSettings  # noqa: E402
from powerinfer_tools.runtime.loader import load_runtime_model  # noqa: E402


def skeleton_of(model_path: Path, work: Path) -> Path:
    """A tiny-matrix model with the layer count of ``model_path`` (built once, then reused)."""
    spec = load_runtime_model(model_path, use_split=False).spec
    path = work / f"skeleton-{spec.n_layers}.powerinfer.gguf"
    if not path.exists():
        shape = Shape(64, 256, spec.n_layers, 4, 2, vocab_size=4096, context=spec.max_positions)
        fast = TrainSettings(epochs=1, min_epoch_steps=20, batch_size=64, min_precision=0.0)
        synthesize(shape, path, "q4_0", Planting(), profile_tokens=800, train=fast, progress=False)
    return path


def decode_seconds(model, steps: int, prompt: int = 16) -> float:
    """Median seconds per one-token step after a short prompt."""
    caches = model.new_cache()
    model.forward(np.arange(5, 5 + prompt), caches, all_logits=False)
    times = []
    for i in range(steps):
        start = time.perf_counter()
        model.forward(np.array([100 + i]), caches, all_logits=False).argmax()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="PowerInfer GGUF with predictors")
    parser.add_argument("--work", type=Path, default=Path("/tmp/pi-overhead"))
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    kernels.set_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    models = {"model": args.model, "skeleton": skeleton_of(args.model, args.work)}
    loaded = {name: load_runtime_model(path, use_split=False) for name, path in models.items()}
    cases = [(name, mode, path) for name in models for mode in (FFNMode.SPARSE, FFNMode.DENSE)
             for path in ("compiled", "general")]
    times = {case: [] for case in cases}
    for _ in range(args.runs + 1):  # the first round warms up (compilation cache, page faults)
        for case in cases:
            name, mode, path = case
            model = loaded[name]
            model.mode, model.compiled_decoding = mode, path == "compiled"
            times[case].append(decode_seconds(model, args.steps))
    print(f"{args.model.name}: {loaded['model'].spec.n_layers} layers, {args.threads} threads, "
          f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, medians of {args.runs} runs of {args.steps} steps")
    print(f"{'mode':7} {'path':9} {'model ms/token':>14} {'skeleton ms/token':>17} {'overhead share':>14}")
    for mode in (FFNMode.SPARSE, FFNMode.DENSE):
        for path in ("compiled", "general"):
            full = statistics.median(times["model", mode, path][1:]) * 1e3
            skeleton = statistics.median(times["skeleton", mode, path][1:]) * 1e3
            print(f"{mode.value:7} {path:9} {full:14.2f} {skeleton:17.3f} {skeleton / full:14.1%}")


if __name__ == "__main__":
    main()
