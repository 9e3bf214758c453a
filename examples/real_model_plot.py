"""Plot the sparsity sweeps of real models (``examples/real_model_sparsity.py --json``): docs/lab/real-models.png.

    python examples/real_model_plot.py SmolLM2=docs/lab/bench/smollm2-cats-sweep.json \
        "Gemma 3=docs/lab/bench/gemma3-cats-sweep.json" -o docs/lab/real-models.png

Three panels against the share of FFN neurons a token computes (dense at 100%): held-out perplexity over the
same weights run dense (the sparse file's dense mode, where the sweep measured it), sparse generation speed over
our dense engine beside what the bytes promise (dense bytes per token over sparse), and sparse generation speed
over llama.cpp on the dense file. The points ``--max-quality-loss`` chose are ringed, apart from the line of
uniform points.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402


def _sweep(argument: str) -> tuple[str, dict]:
    name, _, path = argument.rpartition("=")
    return name or Path(path).stem, json.loads(Path(path).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweeps", nargs="+", metavar="NAME=SWEEP.json")
    parser.add_argument("-o", "--output", type=Path, default=Path("docs/lab/real-models.png"))
    args = parser.parse_args()
    figure, (quality, versus_dense, versus_llamacpp) = plt.subplots(1, 3, figsize=(15, 4.4))
    for color, (name, sweep) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], map(_sweep, args.sweeps)):
        # the uniform points make the line; the one --max-quality-loss chose (per-layer) is a ring beside it
        rows = sorted((r for r in sweep["rows"] if not r["point"].startswith("chosen")), key=lambda r: r["computed"])
        computed = [100 * r["computed"] for r in rows]
        chosen = [(100 * r["computed"], r) for r in sweep["rows"] if r["point"].startswith("chosen")]
        dense = sweep.get("layout_dense_perplexity", sweep["dense_perplexity"])  # the same weights, dense
        loss = [100 * (r["perplexity"] / dense - 1) for r in rows]
        quality.plot(computed, loss, "o-", color=color, label=name)
        versus_dense.plot(computed, [r["sparse_vs_dense_generation"] for r in rows], "o-", color=color,
                          label=f"{name}: measured")
        versus_dense.plot(computed, [r["bytes_ratio"] for r in rows], "--", color=color,
                          label=f"{name}: bytes promise")
        versus_llamacpp.plot(computed, [r["sparse_vs_llamacpp_generation"] for r in rows], "o-", color=color,
                             label=name)
        for x, r in chosen:
            for axes, y in ((quality, 100 * (r["perplexity"] / dense - 1)),
                            (versus_dense, r["sparse_vs_dense_generation"]),
                            (versus_llamacpp, r["sparse_vs_llamacpp_generation"])):
                axes.plot(x, y, "o", ms=14, mfc="none", color=color)
    quality.set(ylabel="held-out perplexity over dense (%)", title="quality (ringed: --max-quality-loss 5%)")
    versus_dense.set(ylabel="sparse / our dense", title="generation speed against the bytes promise")
    versus_llamacpp.set(ylabel="sparse / llama.cpp (dense file)", title="generation speed against llama.cpp")
    for axes in (versus_dense, versus_llamacpp):
        axes.axhline(1.0, color="grey", lw=0.8)
    for axes in (quality, versus_dense, versus_llamacpp):
        axes.set_xlabel("FFN neurons computed (%)")
        axes.invert_xaxis()  # sparser to the right
        axes.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%d"))
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(args.output, dpi=110)
    print(args.output)


if __name__ == "__main__":
    main()
