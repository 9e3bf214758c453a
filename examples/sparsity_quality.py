"""Perplexity against sparsity for the training-free rules (CATS, TEAL, both) on a SiLU model.

    python examples/sparsity_quality.py [--model examples/tiny-silu-llama] [--json report.json]

For every rule and target sparsity, the model is converted (f32, so that only the rule changes the
result) with thresholds calibrated on the first --calibration-tokens tokens of its held-out text, and
its perplexity measured by the runtime in sparse mode on the --eval-tokens tokens after them: text the
calibration never saw. Dense perplexity (sparsity 0) is measured the same way on the dense conversion.
Each row gives the computed share of FFN neurons (those whose up row is read). Every number comes from
the `pitools` commands printed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import tempfile
from pathlib import Path

from powerinfer_tools.bundled import BUNDLED_SILU_MODEL
from powerinfer_tools.formats.activation_thresholds import SparsityRule

SPARSITIES = (0.25, 0.4, 0.5, 0.6)


def pitools(*args) -> str:
    command = ["pitools", *map(str, args)]
    print("$", shlex.join(command), flush=True)
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def perplexity(model: Path, mode: str, args) -> dict:
    report = json.loads(pitools("perplexity", model, "--mode", mode, "--json", "-q", "--corpus",
                                args.model / "heldout.txt", "--skip-tokens", args.calibration_tokens,
                                "--tokens", args.eval_tokens))
    selection = report.get("selection") or {}
    return {"perplexity": report["perplexity"], "computed_density": selection.get("computed_density", 1.0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=BUNDLED_SILU_MODEL, help="a SiLU checkpoint folder with heldout.txt")
    p.add_argument("--calibration-tokens", type=int, default=4096)
    p.add_argument("--eval-tokens", type=int, default=16384)
    p.add_argument("--sparsities", type=float, nargs="+", default=SPARSITIES)
    p.add_argument("--json", type=Path, help="write the rows here too")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dense = Path(pitools("convert", args.model, "--dense", "--outtype", "f32", "-q", "-o",
                             Path(tmp) / "dense.gguf").strip())
        rows.append({"rule": "dense", "target": 0.0, **perplexity(dense, "dense", args)})
        for rule in SparsityRule:
            for target in args.sparsities:
                path = Path(tmp) / f"{rule.name}-{target}.powerinfer.gguf"
                pitools("convert", args.model, "--target-sparsity", target, "--sparsity-rule", rule.value,
                        "--tokens", args.calibration_tokens, "--outtype", "f32", "-q", "-o", path)
                rows.append({"rule": rule.value, "target": target, **perplexity(path, "sparse", args)})
                path.unlink()
    base = rows[0]["perplexity"]
    print(f"\n{'rule':10} {'target':>6} {'perplexity':>10} {'vs dense':>8} {'neurons computed':>16}")
    for row in rows:
        row["vs_dense"] = row["perplexity"] / base - 1
        print(f"{row['rule']:10} {row['target']:6.2f} {row['perplexity']:10.3f} {row['vs_dense']:+8.2%} "
              f"{row['computed_density']:16.3f}")
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "calibration_tokens": args.calibration_tokens,
                                         "eval_tokens": args.eval_tokens, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
