"""Recall and precision of trained predictors stored as f32, f16, q8_0 or q4_0, computed as the runtime computes them.

    python examples/predictor_storage_recall.py PROFILE PREDICTORS [--tokens 4096] [--types f32,f16,q8_0,q4_0]
                                               [--json]

PROFILE is a folder from `pitools profile` (or the work folder's `profile/` of `pitools synth --keep-work`),
PREDICTORS the predictor folder trained on it (`predictors/` there). The pairs `pitools train-predictors`
held out (the profile's last rows) are the test set: at most --tokens of them per layer.

Every (fc1 type, fc2 type) pair is encoded with the converter's quantizer (`formats.quantization.encode`),
falling back as the converter does (`tensor_type`: rows that are not whole 32-value blocks, as fc2's are
at a hidden size of 8, stay f16), and run through the runtime's `Predictor` on the CPU 32 tokens at a
time: ggml's vec_dot on the stored rows with the input q8_0- or f16-encoded, as decoding computes it.
Printed, pooled over every layer, token and neuron: recall and precision against the profile's held-out
firing, the share of decisions that differ from the float32 predictor's, the computed share of neurons,
and the predictors' bytes read per token (all layers).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from powerinfer_tools import kernels
from powerinfer_tools.formats.constants import predictor_names
from powerinfer_tools.formats.predictor_folder import predict, read_predictors
from powerinfer_tools.formats.profile_folder import load_profile
from powerinfer_tools.formats.quantization import F16, OUTTYPES, encode, tensor_type
from powerinfer_tools.kernels.quant import QuantMatrix
from powerinfer_tools.predictors.trainer import TrainSettings, open_pairs
from powerinfer_tools.runtime.backends import CpuBackend
from powerinfer_tools.runtime.ffn import Predictor


def stored(w: np.ndarray, type_name: str, name: str) -> QuantMatrix:
    """``w`` as the converter would store it when asked for ``type_name``."""
    qtype = tensor_type(name, w.shape, OUTTYPES[type_name], is_output=False)
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


def measure(profile: Path, predictors: Path, types: list[str], tokens: int) -> dict[tuple[str, str], dict]:
    meta, _ = load_profile(profile, require_complete=True)
    folder = read_predictors(predictors)
    store, n_train = open_pairs(profile, meta, TrainSettings())
    held_out = np.arange(n_train, min(n_train + tokens, meta["pairs_capacity"]))
    counts = {(t1, t2): Counts() for t1 in types for t2 in types}
    backend = CpuBackend()
    for layer in range(meta["n_layers"]):
        x = store.x[layer][held_out].astype(np.float32)
        fired = np.unpackbits(store.fired[layer][held_out], axis=1, count=meta["d_ff"]).view(bool)
        fc1, fc2 = (np.asarray(w, dtype=np.float32) for w in folder.layer(layer))
        float32_chosen = predict(np, fc1, fc2, x)
        fc1_name, fc2_name = (f"{name}.weight" for name in predictor_names(layer))
        for (t1, t2), c in counts.items():
            p = Predictor(backend, stored(fc1, t1, fc1_name), stored(fc2, t2, fc2_name))
            c.add(run_decoding(p, x), fired, float32_chosen)
            c.bytes += p.nbytes
            c.types.add(f"{p.fc1.qtype.name.lower()}+{p.fc2.qtype.name.lower()}")
        print(f"layer {layer}: done", flush=True)
    return {key: c.row() for key, c in counts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path)
    parser.add_argument("predictors", type=Path)
    parser.add_argument("--tokens", type=int, default=4096, help="held-out tokens per layer at most")
    parser.add_argument("--types", default="f32,f16,q8_0,q4_0")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = measure(args.profile, args.predictors, args.types.split(","), args.tokens)
    if args.json:
        print(json.dumps([{"fc1": t1, "fc2": t2, **row} for (t1, t2), row in rows.items()], indent=1))
        return
    reference = rows["f32", "f32"]
    print(f"{'fc1':>5} {'fc2':>5} {'stored as':>16} {'recall':>7} {'d recall':>8} {'precision':>9} "
          f"{'computed':>8} {'differs':>8} {'KiB/token':>9}")
    for (t1, t2), r in rows.items():
        print(f"{t1:>5} {t2:>5} {r['stored_as']:>16} {r['recall']:7.2%} {100 * (r['recall'] - reference['recall']):+8.2f} "
              f"{r['precision']:9.2%} {r['computed']:8.2%} {r['differs_from_f32']:8.3%} {r['bytes_per_token'] / 1024:9.1f}")


if __name__ == "__main__":
    main()
