"""Held-out perplexity against overall sparsity, the greedy per-layer allocation against the uniform one (every
layer equally sparse), as ``pitools convert --max-quality-loss`` measures both and keeps the better
(``profiling/quality.py``).

    python examples/allocation_curve.py MODEL.gguf --corpus calib.txt [--tokens 12000] [--rule cats] [--json out.json]

The calibration tokens are split as ``--max-quality-loss`` splits them (the last fifth, at most 2,048 tokens, held
out), the sensitivity run samples each layer's magnitudes on the dense model with the same seed, and each point's
thresholds are those quantiles. So the rows are the perplexities ``convert --max-quality-loss`` compares for the
same model, corpus, --tokens and rule.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from powerinfer_tools.conversion.sparsify import SparsifySettings, model_on_corpus
from powerinfer_tools.formats.activation_thresholds import ActivationThresholds, SparsityRule
from powerinfer_tools.profiling import quality
from powerinfer_tools.profiling.calibration import layer_thresholds
from powerinfer_tools.profiling.perplexity import perplexity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=25_000)
    parser.add_argument("--rule", choices=[r.value for r in SparsityRule], default="cats")
    parser.add_argument("--seq-len", type=int, default=SparsifySettings.seq_len)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rule = SparsityRule(args.rule)
    model, _, tokens = model_on_corpus(args.model, SparsifySettings(corpus=(args.corpus,), tokens=args.tokens))
    seq_len = min(args.seq_len, model.spec.max_positions)
    rest, held = quality.held_out_split(tokens)
    start = time.monotonic()
    found = quality.sensitivity(model, rest, rule, seq_len, np.random.default_rng(0), progress=True)
    timings = {"sensitivity_s": time.monotonic() - start}

    def held_out(targets: tuple[float, ...] | None, point: float) -> float:
        thresholds = None if targets is None else ActivationThresholds(rule, point, tuple(
            layer_thresholds(sampler, rule, t) for sampler, t in zip(found.samplers, targets)))
        return perplexity(model, held, seq_len, f"{rule.value} {point:.0%}", progress=False,
                          thresholds=thresholds).perplexity

    start = time.monotonic()
    dense = held_out(None, 0.0)
    rows = []
    for point in quality.POINTS:
        allocation = quality.allocate(found.costs, point)
        rows.append({"sparsity": point, "uniform": held_out((point,) * model.spec.n_layers, point),
                     "greedy": held_out(allocation, point), "allocation": allocation})
        print(f"{point:4.0%}  uniform {rows[-1]['uniform']:.3f} ({rows[-1]['uniform'] / dense - 1:+.1%})  "
              f"greedy {rows[-1]['greedy']:.3f} ({rows[-1]['greedy'] / dense - 1:+.1%}) per layer {allocation}",
              flush=True)
    timings["perplexity_s"] = time.monotonic() - start
    report = {"model": str(args.model), "rule": rule.value, "calibration_tokens": len(rest),
              "held_out_tokens": len(held), "dense": dense, "points": rows, **timings}
    print(f"dense {dense:.3f}; {json.dumps(timings)}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
