"""Plot generation speed against a memory limit, one line per engine, from `pitools bench --json` reports.

    python examples/memory_limit_plot.py "llama-7b" 50=l7-50.json 75=l7-75.json 100=l7-100.json \\
        none=l7-free.json -o docs/lab/memory_limit.png

Each ``PERCENT=REPORT`` is a report made with ``--memory-limit`` at that percentage of the model file
(``none``: without a limit, drawn at the right edge). An engine missing from a report (it cannot start
under that limit) has no point there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

ENGINES = {"sparse": "ours, sparse (under a limit: --ram, neuron cache)", "llama.cpp": "llama.cpp, its best under the limit"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("title")
    parser.add_argument("reports", nargs="+", metavar="PERCENT=REPORT.json")
    parser.add_argument("-o", "--output", type=Path, default=Path("docs/lab/memory_limit.png"))
    args = parser.parse_args()
    points = {name: [] for name in ENGINES}
    limited = [int(r.split("=", 1)[0]) for r in args.reports if not r.startswith("none=")]
    free_x = max(limited, default=100) + 25
    for item in args.reports:
        percent, path = item.split("=", 1)
        x = free_x if percent == "none" else int(percent)
        engines = json.loads(Path(path).read_text())["engines"]
        for name in ENGINES:
            if name in engines:
                points[name].append((x, engines[name]["generation_tokens_per_s"]))
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for name, label in ENGINES.items():
        xs, ys = zip(*sorted(points[name])) if points[name] else ((), ())
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_xticks(sorted(set(limited)) + [free_x], [f"{p}%" for p in sorted(set(limited))] + ["no limit"])
    ax.set_xlabel("memory limit (cgroup, page cache counted), % of the model file")
    ax.set_ylabel("generation tokens/s (log)")
    ax.set_title(args.title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(args.output)


if __name__ == "__main__":
    main()
