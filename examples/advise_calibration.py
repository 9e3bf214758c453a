"""How fast sparse decoding reads its bytes against dense decoding, from `pitools bench --json` reports: the share
of the bytes' promise that sparse generation reached, per report, and their median (``advice.SPARSE_READ_RATE``).

    python examples/advise_calibration.py docs/lab/bench/*realistic-context.gate*.bench.json ...

A report counts where it ran both of our engines (sparse and dense): its ``sparse_vs_dense_generation`` over
the dense / sparse bytes per token its engines read. `pitools advise` predicts a file's sparse / dense ratio as
its bytes' promise times that median.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def reached(report: dict) -> float | None:
    """The share of its bytes' promise a report's sparse generation reached; None without both engines."""
    engines = report.get("engines", {})
    if "sparse" not in engines or "dense" not in engines or "sparse_vs_dense_generation" not in report:
        return None
    promise = engines["dense"]["bytes_per_token"] / engines["sparse"]["bytes_per_token"]
    return report["sparse_vs_dense_generation"] / promise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", type=Path, metavar="REPORT.json")
    args = parser.parse_args()
    shares = []
    for path in args.reports:
        share = reached(json.loads(path.read_text()))
        if share is None:
            print(f"{path}: no sparse and dense engines, left out")
            continue
        shares.append(share)
        print(f"{path}: sparse generation reached {share:.3f} of its bytes' promise")
    if not shares:
        raise SystemExit("no report ran both engines")
    quartiles = statistics.quantiles(shares, n=4) if len(shares) > 1 else [shares[0]] * 3
    print(f"median of {len(shares)}: {statistics.median(shares):.3f} (quartiles {quartiles[0]:.3f}, {quartiles[2]:.3f})")


if __name__ == "__main__":
    main()
