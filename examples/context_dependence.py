"""How much of a real model's FFN gate pre-activation the token id alone decides, and how much its context
does: the numbers a synthetic benchmark model whose firing depends on context is calibrated to.

SmolLM2-135M-Instruct (SwiGLU) runs over the tokens of ``calib.txt`` (``real_models.english_texts``), in
windows of 512 tokens, each a fresh forward pass from an empty cache. Only the tokens whose id occurs at least
``--min-occurrences`` times in the sample count, so that every id has a mean to deviate from. Per layer:

* **within-id share** of the gate pre-activation's variance, per neuron: the pooled within-id sum of squares
  over the total sum of squares of the same tokens, then its mean and median over neurons. 0: the id alone
  decides the pre-activation; 1: the id says nothing. With N tokens in G ids a share of (N − G)/(N − 1) arises
  by chance alone (the expected value with no id effect: the **chance** column), so the id-explained share is
  also given corrected for chance (ω², mean over neurons: 0 when the id explains nothing beyond chance).
* **firing agreement**: a neuron fires where |SiLU(gate)·up| is among the top ``--density`` (10%) of the
  layer's activations over all sampled tokens and neurons (SmolLM2 has no exact zeros; 10% is what ReLU models
  fire). Over ordered pairs of occurrences (a, b) of the same id: P(the neuron fires at b | it fires at a),
  pooled over neurons and ids (Σ f(f − 1) / Σ f(k − 1), f of an id's k occurrences firing). The chance level
  is the same over every ordered pair of tokens of different ids, computed exactly rather than sampled.

``--synth SHAPE`` measures a synthetic model of ``pitools synth --hardness realistic`` instead (its checkpoint
written to a temporary folder; ``--context`` in place of the level's): what the level's context is set by.

    python examples/context_dependence.py [MODEL.gguf or CHECKPOINT_FOLDER] [--tokens 8192] [--layers 0,5,...]
        [--min-occurrences 4] [--json /work/smol/context_dependence.json]
    python examples/context_dependence.py --synth tinyllama-1.1b [--context 0.82]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from powerinfer_tools.benchmarking import synth
from powerinfer_tools.benchmarking.real_models import english_texts, fetch
from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.conversion.gguf_source import GGUFSource
from powerinfer_tools.models import load_model
from powerinfer_tools.progress import progress_bar

WINDOW = 512  # tokens per forward pass, each from an empty cache (as pitools profile's windows)


def calibration_tokens(tokenizer, count: int) -> np.ndarray:
    """The first ``count`` tokens of ``calib.txt``."""
    with tempfile.TemporaryDirectory() as folder:
        _, calib = english_texts(Path(folder))
        text = calib.read_text(encoding="utf-8")[: count * 8]  # ~4 characters a token: enough, not all
    tokens = np.array(tokenizer.encode(text, add_bos=False), np.int64)[:count]
    if len(tokens) < count:
        raise SystemExit(f"calib.txt has only {len(tokens)} tokens, fewer than --tokens {count}")
    return tokens


def record(model, tokens: np.ndarray, layers: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per layer: the gate pre-activation ``[T, d_ff]`` float32 and |activation| ``[T, d_ff]`` float16."""
    seen: dict[int, list] = {i: [] for i in layers}

    def hook(trace):
        if trace.layer in seen:
            seen[trace.layer].append((trace.gate_pre.astype(np.float32),
                                      np.abs(trace.activated).astype(np.float16)))

    model.ffn_hook, model.compute_logits = hook, False
    with progress_bar(total=len(tokens), unit="tok", desc="recording calib.txt") as bar:
        for start in range(0, len(tokens), WINDOW):
            model.forward(tokens[start : start + WINDOW], model.new_cache())
            bar.update(min(WINDOW, len(tokens) - start))
    model.ffn_hook = None
    return {i: (np.concatenate([g for g, _ in parts]), np.concatenate([a for _, a in parts]))
            for i, parts in seen.items()}


def id_groups(tokens: np.ndarray, min_occurrences: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions of the qualifying tokens sorted by id, where each id's run starts, each id's count)."""
    ids, counts = np.unique(tokens, return_counts=True)
    kept = ids[counts >= min_occurrences]
    positions = np.flatnonzero(np.isin(tokens, kept))
    order = positions[np.argsort(tokens[positions], kind="stable")]
    _, starts, group_counts = np.unique(tokens[order], return_index=True, return_counts=True)
    return order, starts, group_counts


def within_id_share(gate: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per neuron: (within-id over total sum of squares, ω²) of ``gate`` ``[N, d_ff]`` (rows sorted by id)."""
    x = gate.astype(np.float64)
    x -= x.mean(axis=0)  # centred, so that the sums of squares below do not cancel catastrophically
    total = (x * x).sum(axis=0)
    sums = np.add.reduceat(x, starts, axis=0)
    between = (sums * sums / counts[:, None]).sum(axis=0)
    within = total - between
    n, g = len(x), len(counts)
    mean_square_within = within / (n - g)
    omega2 = (between - (g - 1) * mean_square_within) / (total + mean_square_within)
    return within / total, omega2


def firing_agreement(fired: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> tuple[float, float]:
    """(same id, different ids): P(a neuron fires at token b | it fires at token a), pooled over neurons,
    over ordered pairs of distinct tokens of ``fired`` ``[N, d_ff]`` (rows sorted by id)."""
    f = np.add.reduceat(fired.astype(np.int64), starts, axis=0)  # [G, d_ff] firings among each id's k
    k = counts[:, None]
    same = (f * (f - 1)).sum() / (f * (k - 1)).sum()
    # Over all ordered pairs of distinct tokens, co-firings are Σ_n S_n(S_n − 1); the same-id pairs' share of
    # them is Σ f(f − 1), which leaves Σ S_n² − Σ f² for the pairs of different ids.
    per_neuron = f.sum(axis=0)
    different = ((per_neuron * per_neuron).sum() - (f * f).sum()) / (f * (len(fired) - k)).sum()
    return float(same), float(different)


def layer_stats(gate: np.ndarray, magnitude: np.ndarray, groups, density: float) -> dict:
    order, starts, counts = groups
    threshold = np.quantile(magnitude.astype(np.float32), 1 - density)  # over every sampled token, not just these
    share, omega2 = within_id_share(gate[order], starts, counts)
    same, different = firing_agreement(magnitude[order] > threshold, starts, counts)
    return {"within_id_share_mean": float(share.mean()), "within_id_share_median": float(np.median(share)),
            "omega2_mean": float(omega2.mean()), "threshold": float(threshold),
            "firing_agreement_same_id": same, "firing_agreement_different_ids": different}


COLUMNS = (("within_id_share_mean", "within mean"), ("within_id_share_median", "within median"),
           ("chance", "chance"), ("omega2_mean", "id ω² mean"),
           ("firing_agreement_same_id", "fire agree same"), ("firing_agreement_different_ids", "fire agree diff"))


def print_table(rows: dict[int, dict], chance: float) -> None:
    print("layer " + " ".join(f"{title:>15}" for _, title in COLUMNS))
    for layer, row in rows.items():
        print(f"{layer:5} " + " ".join(f"{row.get(key, chance):15.3f}" for key, _ in COLUMNS))
    means = {key: np.mean([row.get(key, chance) for row in rows.values()]) for key, _ in COLUMNS}
    print(" mean " + " ".join(f"{means[key]:15.3f}" for key, _ in COLUMNS))


def synthetic(shape: str, context: float | None, folder: Path) -> tuple[Path, str]:
    """A realistic synthetic checkpoint of ``shape`` written into ``folder`` (with ``context``, if given), and
    what it is, for the report."""
    planting = synth.HARDNESS["realistic"].planting(synth.SHAPES[shape], 0.1, 0)
    if context is not None:
        planting = replace(planting, context=context)
    synth.write_checkpoint(folder, synth.SHAPES[shape], planting)
    return folder, f"synth {shape}, realistic, context {planting.context}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", type=Path,
                        help="a GGUF file or a checkpoint folder [default: SmolLM2-135M-Instruct, fetched]")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of calib.txt to run")
    parser.add_argument("--layers", help="comma-separated layer indices [default: all]")
    parser.add_argument("--min-occurrences", type=int, default=4, help="an id counts if it occurs this often")
    parser.add_argument("--density", type=float, default=0.1, help="share of activations counted as firing")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--synth", choices=list(synth.SHAPES), help="measure a realistic synthetic model of this shape")
    parser.add_argument("--context", type=float, help="--synth: its context [default: the realistic level's]")
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        if args.synth:
            path, name = synthetic(args.synth, args.context, Path(folder))
        else:
            path = args.model or fetch("smollm2")
            name = str(path)
        source = Checkpoint(path) if path.is_dir() else GGUFSource(path)
        model = load_model(source)
        tokens = calibration_tokens(source.tokenizer(model.spec), args.tokens)
    layers = [int(v) for v in args.layers.split(",")] if args.layers else list(range(model.spec.n_layers))
    traces = record(model, tokens, layers)
    groups = id_groups(tokens, args.min_occurrences)
    n, g = len(groups[0]), len(groups[1])
    chance = (n - g) / (n - 1)
    print(f"{n} of {len(tokens)} tokens qualify ({g} ids of {len(np.unique(tokens))} occur ≥ "
          f"{args.min_occurrences} times); within-id share by chance alone: (N − G)/(N − 1) = {chance:.3f}")
    rows = {layer: layer_stats(*traces.pop(layer), groups, args.density) for layer in layers}
    print_table(rows, chance)
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({
            "model": name,
            "tokens": len(tokens), "window": WINDOW, "min_occurrences": args.min_occurrences,
            "density": args.density, "qualifying_tokens": n, "qualifying_ids": g, "chance_within_id_share": chance,
            "layers": rows, "mean_over_layers": {key: float(np.mean([r.get(key, chance) for r in rows.values()]))
                                                 for key, _ in COLUMNS}}, indent=2))


if __name__ == "__main__":
    main()
