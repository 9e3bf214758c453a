"""Neuron predictors: per layer a small MLP that guesses which FFN neurons fire.

PowerInfer's runtime computes ``out = fc2 · relu(fc1 · x)`` on the residual
stream ``x`` entering the FFN block (before its norm; the profile's pairs hold it
scaled per token, see ``formats.profile_folder.predictor_input``) and computes neuron ``j``
only when ``out[j] >= sparse_threshold`` (its sparse kernels skip rows with
``out < threshold``). There is no bias anywhere, so a per-layer threshold shift
cannot be stored; the recall target is reached instead by class weighting: a
controller raises the weight of the "fires" class while the held-out recall is
short of the target and eases it when recall is comfortably above.

Each layer's hidden size is the smallest of a ladder that reaches the recall
target with at least ``min_precision`` precision (so it does not buy recall by
predicting nearly every neuron), within what is left of the byte budget for all
predictors (a fraction of the FFN weights). Layers whose firing is easy to
predict stop early and leave their share of the budget to later layers.

Training is NumPy, or CuPy when a CUDA GPU is present: the code uses an array
module ``xp``. Initial weights and the batch order come from NumPy generators
seeded by (seed, layer, hidden size), so a run is reproducible, and resumable
per layer: the output folder is rewritten after every layer.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

import numpy as np

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.predictor_folder import (
    FORMAT,
    META_FILE,
    SPARSE_THRESHOLD,
    VERSION,
    PredictorFolder,
    predict,
    read_predictors,
)
from powerinfer_tools.formats.profile_folder import PAIRS_DIR, PairStore, load_profile
from powerinfer_tools.progress import progress_bar
from powerinfer_tools.xp import cupy_or_none

EVAL_BATCH = 4096  # rows per step when scoring the held-out pairs


@dataclass(frozen=True)
class TrainSettings:
    recall: float = 0.95  # held-out recall every layer must reach
    budget: float = 0.1  # all predictors' parameters / all FFN weight parameters
    min_precision: float = 0.5  # a ladder size passes only at this precision (or better) at the target recall
    epochs: int = 6  # passes over the training pairs, each at least min_epoch_steps batches long
    extra_epochs: int = 8  # further epochs allowed, raising the class weight, when recall is still short
    min_epoch_steps: int = 200  # so that a small profile still gets enough optimiser steps
    batch_size: int = 512
    lr: float = 2e-3
    val_fraction: float = 0.1  # the last pairs (the corpus's last tokens) are held out
    max_val_pairs: int = 16384
    weight_up: float = 1.5  # class-weight step when recall is short of the target
    weight_down: float = 1.2  # ... and when it exceeds the target by more than recall_slack
    recall_slack: float = 0.01
    seed: int = 0


def hidden_ladder(d_ff: int) -> list[int]:
    """Candidate hidden sizes 8, 12, 16, 24, 32, 48, ... (steps of about sqrt 2), up to ``d_ff``."""
    sizes, base = [], 8
    while base <= d_ff:
        sizes += [s for s in (base, base * 3 // 2) if s <= d_ff]
        base *= 2
    return sizes


def predictor_params(hidden: int, d_model: int, d_ff: int) -> int:
    return hidden * (d_model + d_ff)


def ffn_params(ffn: str, d_model: int, d_ff: int) -> int:
    """Weights of one FFN: gate, up and down for the gated kinds, fc1 and fc2 for OPT's plain ReLU."""
    return (2 if ffn == "relu" else 3) * d_model * d_ff


def array_module(device: str) -> ModuleType:
    """``np`` or ``cupy`` for ``--device auto|cpu|cuda``."""
    if device == "cpu":
        return np
    cupy = cupy_or_none()
    if cupy is None and device == "cuda":
        raise PitoolsError("--device cuda needs CuPy and a CUDA GPU; neither was found (use --device cpu)")
    return cupy if cupy is not None else np


# --- data --------------------------------------------------------------------------------------


@dataclass
class LayerPairs:
    """One layer's training pairs (memory-mapped) and its held-out pairs (in memory: float32 inputs
    divided by ``scale``, bool fired masks)."""

    x: np.ndarray  # [n, d_model] float16 memmap
    fired: np.ndarray  # [n, ceil(d_ff/8)] packed bits memmap
    n_train: int  # rows 0 .. n_train-1 train; the rest are held out
    d_ff: int

    def __post_init__(self):
        self.val_x, self.val_y = self.batch(np.arange(self.n_train, len(self.x)))
        sample_x, sample_y = self.batch(np.arange(0, self.n_train, max(1, self.n_train // 16384)))
        self.density = float(sample_y.mean())
        # Per-feature RMS of the inputs: dividing by it gives Adam equally scaled features.
        self.scale = np.maximum(np.sqrt(np.mean(sample_x * sample_x, axis=0)), 1e-6).astype(np.float32)
        self.val_x /= self.scale  # held-out inputs as the training steps see them, once for every fit

    def batch(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Inputs as float32 and fired masks as bool for the (sorted) ``rows``."""
        return (self.x[rows].astype(np.float32),
                np.unpackbits(self.fired[rows], axis=1, count=self.d_ff).view(bool))


def open_pairs(profile_dir: Path, meta: dict, settings: TrainSettings) -> tuple[PairStore, int]:
    """The profile's training pairs, checked against ``meta`` (its profile.json), and how many of
    each layer's train (the rest are held out)."""
    shape = (meta["pairs_capacity"], meta["d_model"], meta["d_ff"])
    store = PairStore.open(Path(profile_dir) / PAIRS_DIR, meta["n_layers"], shape)
    n = meta["pairs_capacity"]
    n_val = min(settings.max_val_pairs, int(n * settings.val_fraction))
    if n_val < 1 or n - n_val < settings.batch_size:
        raise PitoolsError(
            f"{profile_dir}: only {n} training pairs per layer; profile more tokens (or raise --pairs-mib)"
        )
    return store, n - n_val


# --- model and training ------------------------------------------------------------------------


@dataclass
class Quality:
    """How a predictor does on held-out pairs, counted over every (token, neuron)."""

    recall: float
    precision: float
    predicted_density: float
    true_density: float


def evaluate(xp, fc1, fc2, val_x: np.ndarray, val_y: np.ndarray) -> Quality:
    tp = predicted = 0
    for i in range(0, len(val_x), EVAL_BATCH):
        pred = predict(xp, fc1, fc2, xp.asarray(val_x[i : i + EVAL_BATCH]))
        tp += int((pred & xp.asarray(val_y[i : i + EVAL_BATCH])).sum())
        predicted += int(pred.sum())
    positives = int(val_y.sum())
    return Quality(
        recall=tp / positives if positives else 1.0,
        precision=tp / predicted if predicted else 1.0,
        predicted_density=predicted / val_y.size,
        true_density=positives / val_y.size,
    )


class Adam:
    def __init__(self, xp, params: list, lr: float, betas=(0.9, 0.999), eps=1e-8):
        self.params, self.lr, self.betas, self.eps = params, lr, betas, eps
        self.m = [xp.zeros_like(p) for p in params]
        self.v = [xp.zeros_like(p) for p in params]
        self.t = 0

    def step(self, grads: list) -> None:
        self.t += 1
        b1, b2 = self.betas
        scale = self.lr * math.sqrt(1 - b2**self.t) / (1 - b1**self.t)
        for p, g, m, v in zip(self.params, grads, self.m, self.v):
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            p -= scale * m / (v**0.5 + self.eps)


def gradients(xp, w1, w2, x, y, pos_weight: float) -> list:
    """Gradients of the class-weighted binary cross-entropy of ``logits = w2 · relu(w1 · x)``.

    The loss is ``-w·y·log p - (1-y)·log(1-p)`` with ``p = sigmoid(logits)``,
    summed over neurons and averaged over the batch; ``y`` is the bool fired mask.
    """
    hidden = xp.maximum(x @ w1.T, 0)
    logits = hidden @ w2.T
    prob = 0.5 * (1 + xp.tanh(0.5 * logits))  # sigmoid without overflow
    g = xp.where(y, (pos_weight / len(x)) * (prob - 1), prob / len(x))  # d(loss)/d(logits)
    g_hidden = (g @ w2) * (hidden > 0)
    return [g_hidden.T @ x, g.T @ hidden]


@dataclass
class Fit:
    hidden: int
    fc1: np.ndarray  # [hidden, d_model] float32, input scaling folded in
    fc2: np.ndarray  # [d_ff, hidden] float32
    quality: Quality
    pos_weight: float
    epochs: int


def fit_predictor(data: LayerPairs, hidden: int, settings: TrainSettings, xp, seed: tuple[int, ...]) -> Fit:
    """Train one MLP, steering the class weight until held-out recall reaches the target."""
    rng = np.random.default_rng(seed)
    scale = data.scale
    d_model = data.x.shape[1]
    # He initialisation for the ReLU layer, variance-preserving for the output layer.
    w1 = xp.asarray((rng.standard_normal((hidden, d_model)) * math.sqrt(2 / d_model)).astype(np.float32))
    w2 = xp.asarray((rng.standard_normal((data.d_ff, hidden)) * math.sqrt(1 / hidden)).astype(np.float32))
    opt = Adam(xp, [w1, w2], settings.lr)
    val_x, val_y = xp.asarray(data.val_x), xp.asarray(data.val_y)  # on the device once, not every epoch
    # Start where a calibrated classifier would favour recall: positives weighted by sqrt(neg/pos).
    density = min(max(data.density, 1e-4), 0.5)
    pos_weight = math.sqrt((1 - density) / density)
    batches = _batches(rng, data.n_train, settings.batch_size)
    steps_per_epoch = max(data.n_train // settings.batch_size, settings.min_epoch_steps)
    epoch = 0
    while True:
        for _ in range(steps_per_epoch):
            x, y = data.batch(next(batches))
            opt.step(gradients(xp, w1, w2, xp.asarray(x / scale), xp.asarray(y), pos_weight))
        epoch += 1
        quality = evaluate(xp, w1, w2, val_x, val_y)
        short = quality.recall < settings.recall
        if epoch >= settings.epochs and (not short or epoch >= settings.epochs + settings.extra_epochs):
            break
        if short:
            pos_weight *= settings.weight_up
        elif quality.recall > settings.recall + settings.recall_slack:
            pos_weight /= settings.weight_down
    fc1 = _to_numpy(w1) / scale  # fc1 · (x / s) == (fc1 / s) · x: the runtime feeds raw inputs
    return Fit(hidden, fc1.astype(np.float32), _to_numpy(w2), quality, pos_weight, epoch)


def _batches(rng: np.random.Generator, n: int, size: int):
    """Endless mini-batches of row indices (sorted, for memory-mapped reads), reshuffled every pass."""
    while True:
        order = rng.permutation(n)
        for i in range(0, n - size + 1, size):
            yield np.sort(order[i : i + size])


def _to_numpy(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


def passes(fit: Fit, settings: TrainSettings) -> bool:
    return fit.quality.recall >= settings.recall and fit.quality.precision >= settings.min_precision


def choose_predictor(data: LayerPairs, sizes: list[int], settings: TrainSettings, xp, layer: int,
                     log=lambda message: None) -> tuple[Fit, list[Fit]]:
    """The first size that passes; if none does, the best of those tried (recall first, then precision)."""
    tried: list[Fit] = []
    for hidden in sizes:
        fit = fit_predictor(data, hidden, settings, xp, (settings.seed, layer, hidden))
        tried.append(fit)
        q = fit.quality
        log(f"layer {layer}: hidden {hidden:5d}: recall {q.recall:.1%}, precision {q.precision:.1%}, "
            f"computes {q.predicted_density:.1%} of neurons ({q.true_density:.1%} fire)")
        if passes(fit, settings):
            return fit, tried
    best = max(tried, key=lambda f: (f.quality.recall >= settings.recall,
                                     f.quality.precision if f.quality.recall >= settings.recall else f.quality.recall))
    return best, tried


def train_predictors(profile_dir: Path, out: Path, settings: TrainSettings, device: str = "auto",
                     force: bool = False, progress: bool = True) -> dict:
    """Train (or finish training) every layer's predictor from a complete profile; return predictors.json."""
    profile_dir, out = Path(profile_dir), Path(out)
    profile, _ = load_profile(profile_dir, require_complete=True)
    if not profile["pairs_capacity"]:
        raise PitoolsError(f"{profile_dir}: the profile holds no training pairs "
                           f"(none are recorded for {profile['architecture']} models)")
    xp = array_module(device)
    n_layers, d_model, d_ff = profile["n_layers"], profile["d_model"], profile["d_ff"]
    total_ffn = n_layers * ffn_params(profile["ffn"], d_model, d_ff)
    identity = {
        "format": FORMAT,
        "version": VERSION,
        "sparse_threshold": SPARSE_THRESHOLD,
        "profile": str(profile_dir.resolve()),
        "profile_corpus_sha256": profile["corpus_sha256"],
        "model": profile.get("model"),
        "n_layers": n_layers,
        "d_model": d_model,
        "d_ff": d_ff,
        "ffn_params": total_ffn,
        "budget_params": int(settings.budget * total_ffn),
        "settings": asdict(settings),
    }
    state = _resume(out, identity, force)
    store, n_train = open_pairs(profile_dir, profile, settings)  # every input check before the output exists
    ladder = hidden_ladder(d_ff)
    bar = progress_bar(total=n_layers, initial=len(state.meta["layers"]), unit="layer", desc="predictors",
                       enabled=progress)
    log = bar.write if progress else (lambda message: None)
    out.mkdir(parents=True, exist_ok=True)
    with bar:
        for layer in range(len(state.meta["layers"]), n_layers):
            used = sum(predictor_params(e["hidden"], d_model, d_ff) for e in state.meta["layers"])
            allowed = (identity["budget_params"] - used) / (n_layers - layer)
            sizes = [h for h in ladder if predictor_params(h, d_model, d_ff) <= allowed]
            if not sizes:
                raise PitoolsError(
                    f"the budget {settings.budget:.1%} of the FFN weights leaves layer {layer} "
                    f"{max(allowed, 0):.0f} parameters, less than the smallest predictor "
                    f"({predictor_params(ladder[0], d_model, d_ff)}); raise --budget"
                )
            data = LayerPairs(store.x[layer], store.fired[layer], n_train, d_ff)
            fit, tried = choose_predictor(data, sizes, settings, xp, layer, log)
            state.set_layer(layer, fit.fc1, fit.fc2)
            state.meta["layers"].append(_layer_entry(layer, fit, tried, d_model, d_ff))
            state.meta["complete"] = layer + 1 == n_layers
            state.save(out)
            bar.update(1)
    return state.meta


def _layer_entry(layer: int, fit: Fit, tried: list[Fit], d_model: int, d_ff: int) -> dict:
    q = fit.quality
    return {
        "layer": layer,
        "hidden": fit.hidden,
        "recall": q.recall,
        "precision": q.precision,
        "predicted_density": q.predicted_density,
        "true_density": q.true_density,
        "bytes": 4 * predictor_params(fit.hidden, d_model, d_ff),
        "pos_weight": fit.pos_weight,
        "epochs": fit.epochs,
        "tried": [{"hidden": f.hidden, "recall": f.quality.recall, "precision": f.quality.precision} for f in tried],
    }


def _resume(out: Path, identity: dict, force: bool) -> PredictorFolder:
    if (out / META_FILE).is_file() and not force:
        previous = read_predictors(out, require_complete=False)
        changed = [k for k, v in identity.items() if previous.meta.get(k) != v]
        if changed:
            raise PitoolsError(
                f"{out} holds predictors trained with other settings or from another profile "
                f"(differs: {', '.join(changed)}); use another output folder, or --force to start over"
            )
        # Training adds layers in memory; the finished ones are read from their memory map once.
        return PredictorFolder(previous.meta, {name: np.array(previous.tensors[name]) for name in previous.tensors})
    return PredictorFolder({**identity, "complete": False, "layers": []})
