"""Benchmark the placement ILP on synthetic LLaMA-7B and LLaMA-70B shaped instances.

    python3 examples/bench_solver.py            # all instances, both solvers (about 2 minutes)
    python3 examples/bench_solver.py --solver highs

Firing probabilities follow a power law over a random permutation of each layer's neurons
(probability ~ rank^-1, capped at 1), scaled to a density of 40% in layer 0 and 8-15%
elsewhere, as profiles of ReLU LLaMAs look. Sizes follow the models' shapes; predictors are
taken as rank-1024 f16 MLPs. Results are recorded in docs/lab/solver-benchmark.md.
"""

from __future__ import annotations

import argparse
import platform
from dataclasses import dataclass

import numpy as np
from powerinfer_tools.solver import ilp
from powerinfer_tools.solver.hardware import PRESETS
from powerinfer_tools.solver.problem import kv_cache_bytes_per_token, problem_from_stats
from powerinfer_tools.solver.summary import summary_dict

from powerinfer_tools.units import parse_size

BYTES_PER_WEIGHT = {"f16": 2.0, "q4_0": 18 / 32}  # q4_0: 32 weights in 16 bytes of nibbles + an f16 scale
PREDICTOR_RANK = 1024


@dataclass(frozen=True)
class Shape:
    name: str
    n_layers: int
    n_embd: int
    n_ff: int
    kv_dim: int  # KV heads x head size (grouped-query attention shrinks it)
    vocab: int = 32000


LLAMA_7B = Shape("7B", n_layers=32, n_embd=4096, n_ff=11008, kv_dim=4096)
LLAMA_70B = Shape("70B", n_layers=80, n_embd=8192, n_ff=28672, kv_dim=1024)


@dataclass(frozen=True)
class Instance:
    shape: Shape
    dtype: str
    hardware: str
    vram: str


INSTANCES = (
    Instance(LLAMA_7B, "f16", "rtx2080ti", "11GB"),
    Instance(LLAMA_7B, "q4_0", "rtx2080ti", "3GB"),
    Instance(LLAMA_70B, "q4_0", "rtx4090", "24GB"),
    Instance(LLAMA_70B, "f16", "h200", "100GB"),
)


def power_law_freqs(rng: np.random.Generator, n_layers: int, n_ff: int) -> np.ndarray:
    ranked = np.arange(1, n_ff + 1, dtype=np.float64) ** -1.0
    freqs = np.empty((n_layers, n_ff))
    for layer in range(n_layers):
        density = 0.4 if layer == 0 else rng.uniform(0.08, 0.15)
        lo, hi = 0.0, float(n_ff)  # bisect the scale at which the capped law has this mean
        for _ in range(60):
            scale = (lo + hi) / 2
            lo, hi = (scale, hi) if np.minimum(scale * ranked, 1).mean() < density else (lo, scale)
        freqs[layer] = rng.permutation(np.minimum(lo * ranked, 1))
    return freqs


def stats(shape: Shape, dtype: str, rng: np.random.Generator) -> dict:
    weight = BYTES_PER_WEIGHT[dtype]
    d = shape.n_embd
    attention = (2 * d * d + 2 * d * shape.kv_dim) * weight
    predictor = (d * PREDICTOR_RANK + PREDICTOR_RANK * shape.n_ff) * 2
    return {
        "freqs": power_law_freqs(rng, shape.n_layers, shape.n_ff),
        "neuron_bytes": int(3 * d * weight),  # a row each of gate, up and down (stored transposed)
        "dense_bytes": int(attention + 2 * d * 4),  # plus two f32 norms
        "predictor_bytes": predictor,
        "kv_bytes_per_token": kv_cache_bytes_per_token(shape.kv_dim),
        "head_bytes": int(shape.vocab * d * weight + d * 4),
        "hidden_bytes": d * 4,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--solver", choices=("highs", "cbc", "both"), default="both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gap", type=float, default=0.005, help="relative gap at which the solvers stop")
    args = parser.parse_args()
    solvers = ("highs", "cbc") if args.solver == "both" else (args.solver,)
    print(f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print("| model | weights | hardware | VRAM | objective | solver | solve s | gap | ms/token | tokens/s "
          "| -ngl tokens/s (sparse) | llama.cpp -ngl tokens/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    comparisons = []
    for instance in INSTANCES:
        problem = problem_from_stats(
            **stats(instance.shape, instance.dtype, np.random.default_rng(args.seed)),
            n_ctx=2048,
            budget_bytes=parse_size(instance.vram),
            hardware=PRESETS[instance.hardware],
        )
        token_ms = {}
        for objective in ilp.OBJECTIVES:
            for solver in solvers:
                report = ilp.solve(problem, objective, solver=solver, gap_rel=args.gap)
                summary = summary_dict(problem, report)
                ours, ngl, llama = summary["placement"], summary["layer_granular"], summary["llama_cpp"]
                token_ms[objective] = ours["token_ms"]
                print(f"| {instance.shape.name} | {instance.dtype} | {instance.hardware} | {instance.vram} | "
                      f"{objective} | {solver} | {report.seconds:.2f} | {report.gap:.3%} | {ours['token_ms']:.3f} | "
                      f"{ours['tokens_per_s']:.1f} | {ngl['tokens_per_s']:.1f} | {llama['tokens_per_s']:.1f} |",
                      flush=True)
        gain = token_ms["activations"] / token_ms["latency"] - 1
        comparisons.append(f"{instance.shape.name} {instance.dtype} on {instance.hardware} {instance.vram}: "
                           f"latency objective {token_ms['latency']:.3f} ms/token, activations objective "
                           f"{token_ms['activations']:.3f} ms/token ({gain:+.1%} slower)")
    print("\nPredicted time per token, latency vs activations objective (same instance, last solver):")
    for line in comparisons:
        print(f"- {line}")


if __name__ == "__main__":
    main()
