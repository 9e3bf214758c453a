"""Plot `pitools bench --json` reports: tokens/s by engine and model shape (docs/lab/benchmarks.png).

    python examples/bench_plot.py tinyllama-1.1b=tl.json llama-7b=l7.json -o docs/lab/benchmarks.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

ENGINES = {"sparse": "ours, sparse", "dense": "ours, dense", "llama.cpp": "llama.cpp, dense"}
PANELS = {"generation_tokens_per_s": "generation (tokens/s)", "prompt_tokens_per_s": "prompt processing (tokens/s)"}


def _settings(report: dict) -> str:
    s = report["settings"]
    return f"{s['prompt_tokens']}-token prompt\n{s['generate']} decoded, median of {s['runs']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", metavar="SHAPE=REPORT.json")
    parser.add_argument("-o", "--output", type=Path, default=Path("docs/lab/benchmarks.png"))
    args = parser.parse_args()
    reports = {}
    for item in args.reports:
        shape, path = item.split("=", 1)
        reports[shape] = json.loads(Path(path).read_text())
    shapes = list(reports)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(max(5, 1.6 * len(shapes)) * len(PANELS), 4.6))
    width = 0.8 / len(ENGINES)
    for ax, (key, title) in zip(axes, PANELS.items()):
        everything = []
        for i, (engine, label) in enumerate(ENGINES.items()):
            values = [reports[s]["engines"].get(engine, {}).get(key, 0.0) for s in shapes]
            everything += [v for v in values if v > 0]
            xs = [j + (i - (len(ENGINES) - 1) / 2) * width for j in range(len(shapes))]
            bars = ax.bar(xs, values, width, label=label)
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
        if max(everything) > 10 * min(everything):  # shapes of very different cost: keep both readable
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
            ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(range(len(shapes)), [f"{s}\n{_settings(reports[s])}" for s in shapes], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(ENGINES), fontsize=8)
    fig.suptitle(f"q4_0, {reports[shapes[0]]['settings']['threads']} threads: tokens/s by engine and model shape",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))  # room for the legend below the panels
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
