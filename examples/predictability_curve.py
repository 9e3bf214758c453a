"""How predictable a real model's FFN neurons are: the share of neurons a predictor must compute to
keep 95% recall, by predictor width, on held-out text (issue 33: the bar a realistic benchmark model
must clear).

SmolLM2-135M-Instruct (SwiGLU) has no neuron that is exactly zero, so "firing" stands in as the
neurons of largest |activation|: per layer, those above the magnitude that ``--density`` of the
training tokens' activations exceed (10%: what ReLU models fire). Predictors are our own trainer's
(``predictors.fit.fit_predictor``: the bias-free MLP, class-weighted loss and its steering of recall),
trained on the residual stream entering each FFN, as ``pitools profile`` records it.

Text: the Python Language Reference topics that ship with Python (``pydoc_data.topics``). The first
30,000 characters (``english.txt`` of docs/lab/real-models.md) are the **test** text, never trained or
tuned on; the text after them is cut into training tokens and, after those, the held-out tokens whose
first half steers the trainer's class weight (``LayerPairs``: its tuning split). Reported per width: the share of neurons computed at exactly
95% recall on the test text (the cutoff moved there: what the width can do), and at the trained
threshold the test recall and share (what it did).

    python examples/predictability_curve.py [MODEL.gguf] [--layers 2,14,26] [--widths 16,32,64,128,256,512]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from powerinfer_tools.benchmarking.real_models import fetch
from powerinfer_tools.conversion.gguf_source import GGUFSource
from powerinfer_tools.formats.predictor_rule import SPARSE_THRESHOLD, chooses, scores
from powerinfer_tools.formats.profile_folder import predictor_input
from powerinfer_tools.models import load_model
from powerinfer_tools.predictors.fit import fit_predictor
from powerinfer_tools.predictors.trainer import LayerPairs, TrainSettings
from powerinfer_tools.progress import progress_bar

TEST_CHARS = 30_000  # english.txt of docs/lab/real-models.md
WINDOW = 512  # tokens per forward pass, each from an empty cache (as pitools profile's windows)


def texts(train_tokens: int) -> tuple[str, str]:
    """(test text, training text): the first paragraph-cut 30,000 characters and what follows them."""
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[name] for name in sorted(topics.topics))
    cut = text.index("\n\n", TEST_CHARS)
    return text[:cut], text[cut:][: train_tokens * 8]  # ~4 characters a token: enough, not all


def record(model, tokens: np.ndarray, layers: list[int], label: str) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per layer: the predictor inputs ``[T, d_model]`` float16 and |activation| ``[T, d_ff]`` float16."""
    seen: dict[int, list] = {i: [] for i in layers}

    def hook(trace):
        if trace.layer in seen:
            seen[trace.layer].append((predictor_input(trace.residual).astype(np.float16),
                                      np.abs(trace.activated).astype(np.float16)))

    model.ffn_hook, model.compute_logits = hook, False
    with progress_bar(total=len(tokens), unit="tok", desc=f"recording {label}") as bar:
        for start in range(0, len(tokens), WINDOW):
            model.forward(tokens[start : start + WINDOW], model.new_cache())
            bar.update(min(WINDOW, len(tokens) - start))
    model.ffn_hook = None
    return {i: (np.concatenate([x for x, _ in parts]), np.concatenate([a for _, a in parts]))
            for i, parts in seen.items()}


def computed_at_recall(scores: np.ndarray, fired: np.ndarray, recall: float) -> float:
    """The share of (token, neuron) pairs computed when the cutoff keeps exactly ``recall`` of the firing ones."""
    firing = np.sort(scores[fired])
    cutoff = firing[len(firing) - max(1, math.ceil(recall * len(firing)))]
    return float((scores >= cutoff).mean())


def curve_of_layer(train, test, density: float, widths: list[int], n_train: int, settings: TrainSettings) -> dict:
    (x, magnitude), (test_x, test_magnitude) = train, test
    threshold = np.quantile(magnitude[:n_train].astype(np.float32), 1 - density)
    fired, test_fired = magnitude > threshold, test_magnitude > threshold
    d_ff = fired.shape[1]
    pairs = LayerPairs(x, np.packbits(fired, axis=1), n_train, d_ff)
    rows = []
    for hidden in widths:
        start = time.perf_counter()
        fit = fit_predictor(pairs, hidden, settings, np, (settings.seed, hidden))
        outputs = scores(fit.fc1, fit.fc2, test_x.astype(np.float32))
        predicted = chooses(outputs, SPARSE_THRESHOLD)
        rows.append({"hidden": hidden, "computed_at_95_recall": computed_at_recall(outputs, test_fired, 0.95),
                     "test_recall": float((predicted & test_fired).sum() / test_fired.sum()),
                     "test_computed": float(predicted.mean()), "validation_recall": fit.quality.recall,
                     "epochs": fit.epochs, "seconds": time.perf_counter() - start})
        print(f"  hidden {hidden:4}: {rows[-1]['computed_at_95_recall']:.1%} computed at 95% test recall; "
              f"trained threshold: test recall {rows[-1]['test_recall']:.1%} computing {rows[-1]['test_computed']:.1%} "
              f"({rows[-1]['seconds']:.0f} s)", flush=True)
    return {"threshold": float(threshold), "test_fired": float(test_fired.mean()), "widths": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", type=Path, help="a GGUF file [default: SmolLM2-135M-Instruct, fetched]")
    parser.add_argument("--layers", default="2,14,26")
    parser.add_argument("--widths", default="16,32,64,128,256,512")
    parser.add_argument("--density", type=float, default=0.1, help="share of activations counted as firing")
    parser.add_argument("--train-tokens", type=int, default=20_000)
    parser.add_argument("--validation-tokens", type=int, default=8_000, help="held out: half tunes")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    path = args.model or fetch("smollm2")
    layers, widths = [int(v) for v in args.layers.split(",")], [int(v) for v in args.widths.split(",")]
    source = GGUFSource(path)
    model = load_model(source)
    tokenizer = source.tokenizer(model.spec)
    test_text, train_text = texts(args.train_tokens + args.validation_tokens)
    test_tokens = np.array(tokenizer.encode(test_text, add_bos=False), np.int64)
    train_tokens = np.array(tokenizer.encode(train_text, add_bos=False), np.int64)
    train_tokens = train_tokens[: args.train_tokens + args.validation_tokens]
    train, test = record(model, train_tokens, layers, "training text"), record(model, test_tokens, layers, "test text")
    s = model.spec
    ffn_weights = 3 * s.d_model * s.d_ff
    settings = replace(TrainSettings(), min_precision=0.0)  # every width trains its full course: a curve, not a search
    results = {"model": str(path), "density": args.density, "train_tokens": args.train_tokens,
               "validation_tokens": args.validation_tokens, "test_tokens": len(test_tokens),
               "settings": asdict(settings),
               "predictor_share_of_ffn": {h: h * (s.d_model + s.d_ff) / ffn_weights for h in widths}, "layers": {}}
    for layer in layers:
        print(f"layer {layer}:", flush=True)
        results["layers"][layer] = curve_of_layer(train[layer], test[layer], args.density, widths, args.train_tokens,
                                                  settings)
    print("\nshare of neurons computed at 95% recall on the test text (mean over layers), by predictor width:")
    for i, hidden in enumerate(widths):
        mean = np.mean([r["widths"][i]["computed_at_95_recall"] for r in results["layers"].values()])
        print(f"  hidden {hidden:4} ({results['predictor_share_of_ffn'][hidden]:.1%} of the FFN weights): {mean:.1%}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
