"""Prepared check of the CUDA backend: results equal the CPU's, and both are timed.

Run on a machine with a CUDA GPU and CuPy (``pip install 'powerinfer-tools[cuda]'``):

    python examples/check_cuda.py --out docs/cuda-check.md

It converts the bundled model (f16 and q4_0, with profiling and predictors),
puts the hot half of every layer's neurons (and every dense block and the head) on the GPU
through a split file, and compares logits over held-out text with the CPU-only
runtime in dense and sparse mode; then it times greedy generation on both.
The report (markdown) goes to --out and to stdout. Record it in docs/ when run.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from powerinfer_tools.formats.gpu_split import GpuSplit, write_gpu_split

from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.checkpoints.tokenizer import CheckpointTokenizer
from powerinfer_tools.conversion.convert import convert
from powerinfer_tools.conversion.sparsify import SparsifySettings
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.profiling.corpus import read_tokens, resolve_source
from powerinfer_tools.runtime.loader import load_runtime_model


def logits(model, tokens: np.ndarray) -> np.ndarray:
    window = model.spec.max_positions
    return np.concatenate([model.forward(tokens[s : s + window], model.new_cache())
                           for s in range(0, len(tokens), window)])


def generation_seconds(model, prompt: np.ndarray, n: int, repeats: int) -> float:
    """Median seconds per generated token (greedy, after the prompt)."""
    times = []
    for _ in range(repeats):
        step = model.step_fn()
        token = int(step(prompt).argmax())
        start = time.perf_counter()
        for _ in range(n):
            token = int(step(np.array([token])).argmax())
        times.append((time.perf_counter() - start) / n)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=512, help="held-out tokens compared")
    parser.add_argument("--generate", type=int, default=64, help="tokens generated per timing run")
    parser.add_argument("--profile-tokens", type=int, default=8192, help="calibration tokens for the predictors")
    parser.add_argument("--device", choices=["cuda", "emulated"], default="cuda",
                        help="emulated: run the same script without a GPU (a smoke test of the script itself)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="cuda-check-"))
    tokens = read_tokens(resolve_source((), None, BUNDLED_MODEL), CheckpointTokenizer(BUNDLED_MODEL, 0, 0), args.tokens)
    lines = [f"# {args.device} check ({time.strftime('%Y-%m-%d')}, {platform.node()})", "",
             f"| outtype | mode | max rel. logit error {args.device} vs CPU | top-1 agreement | CPU ms/token "
             f"| {args.device} ms/token |",
             "|---|---|---|---|---|---|"]
    for outtype in ("f16", "q4_0"):
        path, _ = convert(str(BUNDLED_MODEL), work / f"m.{outtype}.gguf", outtype=outtype,
                          sparsify=SparsifySettings(tokens=args.profile_tokens), progress=False)
        cpu = load_runtime_model(path)
        spec = cpu.spec
        masks = tuple(np.arange(spec.d_ff) < spec.d_ff // 2 for _ in range(spec.n_layers))  # hot-first files
        split = work / f"m.{outtype}.gpuidx"
        write_gpu_split(split, GpuSplit(masks, vram_capacity=2**30, dense_on_gpu=(True,) * spec.n_layers,
                                        output_on_gpu=True))
        gpu = load_runtime_model(path, split=split, device=args.device)
        for mode in (FFNMode.DENSE, FFNMode.SPARSE):
            cpu.mode = gpu.mode = mode
            a, b = logits(cpu, tokens), logits(gpu, tokens)
            error = float(np.max(np.abs(a - b)) / np.max(np.abs(a)))
            agree = float(np.mean(a.argmax(-1) == b.argmax(-1)))
            t_cpu = generation_seconds(cpu, tokens[:16], args.generate, 3)
            t_gpu = generation_seconds(gpu, tokens[:16], args.generate, 3)
            lines.append(f"| {outtype} | {mode.value} | {error:.2e} | {agree:.4f} | {t_cpu * 1e3:.2f} | {t_gpu * 1e3:.2f} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out is not None:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
