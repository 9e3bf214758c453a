"""Prepared GPU benchmark (issue 7, point 6): hybrid sparse against a layer-granular offload and all-CPU.

On a machine with a CUDA GPU and CuPy (``pip install 'powerinfer-tools[cuda]'``):

    pitools synth --shape tinyllama-1.1b --outtype q4_0 -o /tmp/tl.powerinfer.gguf
    pitools probe -o /tmp/hw.toml --base h200
    python examples/bench_gpu.py /tmp/tl.powerinfer.gguf --hardware /tmp/hw.toml --out docs/gpu-bench.md

Three placements of the same PowerInfer file, all running its predictors (sparse FFNs), with a
VRAM budget of ``--vram-fraction`` of the model file:

* ``hybrid``: the solver's split (``pitools solve``): hot neurons of every layer on the GPU, cold
  ones on the CPU, dense blocks and the head where the ILP puts them;
* ``layers``: whole layers from the last one back (llama.cpp's ``-ngl`` approach) in the same
  budget (``solver.summary.layer_granular_placement``);
* ``cpu``: everything on the CPU.

They take turns, one generation run each per round, and the medians of generation tokens/s are
printed with the ratios, the share of FFN work on the GPU and the bytes crossing PCIe per token.
``--device emulated`` runs the same script without a GPU: a check of the script itself (the
emulated device computes on the host, so its timings mean nothing).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from powerinfer_tools.formats.gpu_split import write_gpu_split
from powerinfer_tools.solver import ilp
from powerinfer_tools.solver.hardware import DEFAULT_PRESET, load_profile
from powerinfer_tools.solver.problem import DEFAULT_RESERVE_BYTES
from powerinfer_tools.solver.split import model_problem, split_file
from powerinfer_tools.solver.summary import layer_granular_placement

from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.runtime.engine import TokenStats
from powerinfer_tools.runtime.loader import load_runtime_model

PROMPT = np.arange(5, 5 + 32)  # token ids: a random model's quality is irrelevant, its cost is not


def generation_run(model, n: int) -> tuple[float, int]:
    """Seconds for ``n`` greedy tokens after the prompt, and the bytes sent over PCIe meanwhile."""
    step = model.step_fn()
    token = int(step(PROMPT).argmax())
    device = model.device
    sent_before = device.transfers.bytes_to_device + device.transfers.bytes_to_host if device else 0
    start = time.perf_counter()
    for _ in range(n):
        token = int(step(np.array([token])).argmax())
    seconds = time.perf_counter() - start
    sent = device.transfers.bytes_to_device + device.transfers.bytes_to_host - sent_before if device else 0
    return seconds, sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, help="PowerInfer GGUF with predictors and firing frequencies")
    parser.add_argument("--vram-fraction", type=float, default=0.4, help="VRAM budget as a share of the file")
    parser.add_argument("--hardware", default=DEFAULT_PRESET, help="preset or `pitools probe` profile")
    parser.add_argument("--generate", type=int, default=64, help="tokens per run")
    parser.add_argument("--runs", type=int, default=5, help="measured rounds (after one warm-up)")
    parser.add_argument("--device", choices=["cuda", "emulated"], default="cuda")
    parser.add_argument("--out", type=Path, default=None, help="also write the report (markdown) here")
    args = parser.parse_args()

    budget = int(args.model.stat().st_size * args.vram_fraction)
    reserve = DEFAULT_RESERVE_BYTES if args.device == "cuda" else 0
    problem = model_problem(args.model, budget + reserve, load_profile(args.hardware), reserve_bytes=reserve)
    work = Path(tempfile.mkdtemp(prefix="gpu-bench-"))
    placements = {"hybrid": ilp.solve(problem).placement, "layers": layer_granular_placement(problem)}
    models = {"cpu": load_runtime_model(args.model, use_split=False)}
    for name, placement in placements.items():
        path = work / f"{name}.gpuidx"
        write_gpu_split(path, split_file(problem, placement, name))
        models[name] = load_runtime_model(args.model, split=path, device=args.device)
    for model in models.values():
        model.mode = FFNMode.SPARSE

    seconds = {name: [] for name in models}
    pcie = {name: 0 for name in models}
    for round_index in range(args.runs + 1):  # round 0 warms up (compilation, page cache, CUDA context)
        for name, model in models.items():
            model.stats = TokenStats()
            t, sent = generation_run(model, args.generate)
            if round_index:
                seconds[name].append(t)
                pcie[name] = sent
    rate = {name: args.generate / statistics.median(ts) for name, ts in seconds.items()}

    lines = [f"# GPU benchmark: {args.model.name}, {args.device} ({time.strftime('%Y-%m-%d')}, {platform.node()})", "",
             f"VRAM budget {budget / 2**20:.0f} MiB ({args.vram_fraction:.0%} of the file) + {reserve / 2**20:.0f} MiB "
             f"reserve, hardware profile {args.hardware}, {args.generate} tokens per run, medians of {args.runs} runs", "",
             "| placement | GPU layers (dense) | GPU neurons | tokens/s | GPU share of FFN work | PCIe bytes/token |",
             "|---|---|---|---|---|---|"]
    for name, model in models.items():
        placement = placements.get(name)
        layers = sum(placement.dense_on_gpu) if placement else 0
        neurons = sum(placement.gpu_neurons) if placement else 0
        lines.append(f"| {name} | {layers} | {neurons} | {rate[name]:.2f} | {model.stats.device_share:.2f} "
                     f"| {pcie[name] / args.generate:.0f} |")
    lines += ["", f"hybrid / layers: {rate['hybrid'] / rate['layers']:.2f}x; "
                  f"hybrid / cpu: {rate['hybrid'] / rate['cpu']:.2f}x; layers / cpu: {rate['layers'] / rate['cpu']:.2f}x"]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out is not None:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
