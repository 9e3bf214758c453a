"""Recall and precision of predictors stored as f32, f16, q8_0 or q4_0, computed as the runtime computes them.

    python examples/predictor_storage_recall.py --profile DIR --predictors DIR [--tokens 4096] [--json]
    python examples/predictor_storage_recall.py --model MODEL.powerinfer.gguf [--tokens 512] [--json]

Two sources of test inputs and firing:

* ``--profile`` (a folder from `pitools profile`, or the work folder's `profile/` of `pitools synth
  --keep-work`) with ``--predictors`` (the float32 predictor folder trained on it): the pairs
  `pitools train-predictors` held out (the profile's last rows), at most --tokens per layer.
* ``--model``: a PowerInfer file with predictors, run by the runtime on the bundled held-out text
  (--tokens tokens, every neuron computed); each layer's predictor input is the residual entering its
  FFN, its firing what the file's own gate and up compute. The "f32" baseline is then the file's
  predictors as stored, dequantized.

Every (fc1 type, fc2 type) pair is encoded with the converter's quantizer (`formats.quantization.encode`),
falling back as the converter does (rows that are not whole 32-value blocks, as fc2's are at a hidden
size of 8, stay f16), and run through the runtime's `Predictor` on the CPU 32 tokens at a
time: ggml's vec_dot on the stored rows with the input q8_0- or f16-encoded, as decoding computes it.
Printed, pooled over every layer, token and neuron: recall and precision against the firing, the share
of decisions that differ from the float32 predictor's, the computed share of neurons, and the
predictors' bytes read per token (all layers).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES

from powerinfer_tools import kernels
from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.formats.predictor_folder import read_predictors
from powerinfer_tools.formats.predictor_rule import predict
from powerinfer_tools.formats.profile_folder import load_profile
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.models.layers import normalize
from powerinfer_tools.formats.quantization import F16, OUTTYPES, encode
from powerinfer_tools.kernels.quant import QuantMatrix
from powerinfer_tools.predictors.trainer import TrainSettings, open_pairs
from powerinfer_tools.runtime.backends import CpuBackend
from powerinfer_tools.runtime.ffn import Predictor
from powerinfer_tools.runtime.loader import load_runtime_model
from powerinfer_tools.runtime.tokenizer import GGUFTokenizer


def stored(w: np.ndarray, type_name: str) -> QuantMatrix:
    """``w`` stored as ``type_name``, or as f16 when its rows are not whole blocks of it (the converter's fallback)."""
    qtype = OUTTYPES[type_name].weight_type
    if w.shape[-1] % GGML_QUANT_SIZES[qtype][0]:
        qtype = F16
    return QuantMatrix(qtype, w.astype(np.float16) if qtype is F16 else encode(w, qtype))


class Counts:
    """Decisions pooled over layers for one storage choice."""

    def __init__(self):
        self.true_positive = self.predicted = self.fired = self.flipped = self.decisions = self.bytes = 0
        self.types = set()

    def add(self, chosen: np.ndarray, fired: np.ndarray, float32_chosen: np.ndarray) -> None:
        self.true_positive += int((chosen & fired).sum())
        self.predicted += int(chosen.sum())
        self.fired += int(fired.sum())
        self.flipped += int((chosen != float32_chosen).sum())
        self.decisions += chosen.size

    def row(self) -> dict:
        return {"stored_as": "/".join(sorted(self.types)), "recall": self.true_positive / max(self.fired, 1),
                "precision": self.true_positive / max(self.predicted, 1), "computed": self.predicted / self.decisions,
                "differs_from_f32": self.flipped / self.decisions, "bytes_per_token": self.bytes}


def run_decoding(p: Predictor, x: np.ndarray) -> np.ndarray:
    """The predictor's decisions ``[T, d_ff]``, ``kernels.MAX_TOKENS`` tokens per call as decoding calls it."""
    return np.concatenate([p(x[i : i + kernels.MAX_TOKENS]) for i in range(0, len(x), kernels.MAX_TOKENS)])


def profile_layers(profile: Path, predictors: Path, tokens: int):
    """Per layer: (fc1, fc2, inputs, fired) from the profile's held-out pairs and the predictor folder (its
    finished layers: the first ones, when it is incomplete)."""
    meta, _ = load_profile(profile, require_complete=True)
    folder = read_predictors(predictors)
    store, n_train = open_pairs(profile, meta, TrainSettings())
    held_out = np.arange(n_train, min(n_train + tokens, meta["pairs_capacity"]))
    for layer in range(len(folder.meta["layers"])):
        x = store.x[layer][held_out].astype(np.float32)
        fired = np.unpackbits(store.fired[layer][held_out], axis=1, count=meta["d_ff"]).view(bool)
        fc1, fc2 = (np.asarray(w, dtype=np.float32) for w in folder.layer(layer))
        yield fc1, fc2, x, fired


class _EveryNeuron:
    """Stands in for a layer's predictor: keeps what the runtime feeds it and selects every neuron."""

    def __init__(self, d_ff: int):
        self.d_ff, self.inputs = d_ff, []

    def __call__(self, residual):
        self.inputs.append(np.array(residual, dtype=np.float32))
        return np.ones((len(residual), self.d_ff), dtype=bool)


def model_layers(path: Path, tokens: int):
    """Per layer: (fc1, fc2, inputs, fired) from the runtime running the bundled held-out text through ``path``."""
    model = load_runtime_model(path)
    text = (BUNDLED_MODEL / "heldout.txt").read_text(encoding="utf-8")
    ids = np.array(GGUFTokenizer(model.metadata).encode(text, add_bos=True)[:tokens], dtype=np.int64)
    predictors = [layer.dense.predictor for layer in model.layers]
    if any(p is None for p in predictors):
        raise SystemExit(f"{path}: no predictors in the file")
    for layer in model.layers:
        layer.dense.predictor = _EveryNeuron(layer.d_ff)
    model.mode = FFNMode.SPARSE  # the stand-ins select every neuron: the residual stream is the dense one
    model.compiled_decoding = False  # it would read the stand-ins' weights
    model.forward(ids, model.new_cache(), all_logits=False)
    s = model.spec
    for layer, p in zip(model.layers, predictors):
        x = np.concatenate(layer.dense.predictor.inputs)
        h = normalize(s.norm, layer.dense.ffn_norm, x, s.norm_eps)
        fired = np.zeros((len(x), layer.d_ff), dtype=bool)
        for part in layer.partitions:
            fired[:, part.neurons] = part.activations(s.ffn, h, part.neurons) != 0
        yield p.fc1.dequantize_rows(), p.fc2.dequantize_rows(), x, fired


def measure(layers, types: list[str]) -> dict[tuple[str, str], dict]:
    """Pooled counts per (fc1 type, fc2 type) over ``layers`` (from ``profile_layers`` or ``model_layers``),
    after those of the float32 rule in NumPy, keyed ("NumPy", "NumPy")."""
    reference = Counts()  # the float32 rule in NumPy: what the others are compared with
    counts = {(t1, t2): Counts() for t1 in types for t2 in types}
    backend = CpuBackend()
    for layer, (fc1, fc2, x, fired) in enumerate(layers):
        float32_chosen = predict(fc1, fc2, x)
        reference.add(float32_chosen, fired, float32_chosen)
        reference.bytes += fc1.nbytes + fc2.nbytes
        reference.types.add("float32 rule")
        for (t1, t2), c in counts.items():
            p = Predictor(backend, stored(fc1, t1), stored(fc2, t2))
            c.add(run_decoding(p, x), fired, float32_chosen)
            c.bytes += p.nbytes
            c.types.add(f"{p.fc1.qtype.name.lower()}+{p.fc2.qtype.name.lower()}")
        print(f"layer {layer}: {len(x)} tokens", flush=True)
    return {("NumPy", "NumPy"): reference.row()} | {key: c.row() for key, c in counts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", type=Path)
    parser.add_argument("--predictors", type=Path)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--tokens", type=int, default=None,
                        help="test tokens per layer at most [default: 4096 held-out pairs, or 512 tokens of text]")
    parser.add_argument("--types", default="f32,f16,q8_0,q4_0")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.model is not None:
        layers = model_layers(args.model, args.tokens or 512)
    elif args.profile is not None and args.predictors is not None:
        layers = profile_layers(args.profile, args.predictors, args.tokens or 4096)
    else:
        parser.error("give --model, or --profile and --predictors")
    rows = measure(layers, args.types.split(","))
    if args.json:
        print(json.dumps([{"fc1": t1, "fc2": t2, **row} for (t1, t2), row in rows.items()], indent=1))
        return
    reference = rows["NumPy", "NumPy"]
    print(f"{'fc1':>5} {'fc2':>5} {'stored as':>16} {'recall':>7} {'d recall':>8} {'precision':>9} "
          f"{'computed':>8} {'differs':>8} {'KiB/token':>9}")
    for (t1, t2), r in rows.items():
        print(f"{t1:>5} {t2:>5} {r['stored_as']:>16} {r['recall']:7.2%} {100 * (r['recall'] - reference['recall']):+8.2f} "
              f"{r['precision']:9.2%} {r['computed']:8.2%} {r['differs_from_f32']:8.3%} {r['bytes_per_token'] / 1024:9.1f}")


if __name__ == "__main__":
    main()
