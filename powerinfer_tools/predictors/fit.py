"""Training one candidate predictor: a bias-free MLP ``fc2 · relu(fc1 · x)`` under a class-weighted
binary cross-entropy, with Adam, and the early stop of a candidate that cannot pass.

The recall target is reached by class weighting (there is no bias to shift): a controller raises
the weight of the "fires" class after an epoch whose held-out recall is short of the target and
eases it when recall is comfortably above.

**Early stop.** The held-out recall at the runtime's threshold moves with that class weight, so it
says little about what a size can reach. After each epoch the trainer also measures the held-out
*precision at the target recall*: the precision when the cutoff on the outputs is moved to
wherever exactly the target share of the firing neurons is predicted (the best a class weight
could do for this network). A candidate stops when that curve is flattening (its last epoch's
gain is no larger than the one before, give or take ``FLAT`` for the noise of a plateau) and, extended by its last gain for the regular epochs
left (an optimistic straight line, as the curve flattens), stays below ``min_precision``; in the
extra epochs (none left) when it is flattening below ``min_precision``. So the earliest stop is
after the third epoch: a small network's curve often rises slowly at first and then quickly (a
straight line from its first two epochs would stop candidates that pass).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from powerinfer_tools.formats.predictor_rule import SPARSE_THRESHOLD, chooses, hidden_layer, scores

if TYPE_CHECKING:
    from powerinfer_tools.predictors.trainer import LayerPairs, TrainSettings

EVAL_BATCH = 4096  # rows per step when scoring the held-out pairs
FLAT = 0.01  # gains of the precision curve that differ by less are alike (a plateau's epoch-to-epoch noise)


@dataclass
class Quality:
    """How a predictor does on held-out pairs, counted over every (token, neuron)."""

    recall: float
    precision: float
    predicted_density: float
    true_density: float
    precision_at_target: float  # precision with the cutoff moved to give exactly the target recall


def _logits(w1, w2, val_x):
    for i in range(0, len(val_x), EVAL_BATCH):
        yield i, scores(w1, w2, val_x[i : i + EVAL_BATCH])


def evaluate(xp, w1, w2, val_x, val_y, recall_target: float) -> Quality:
    """Quality at the runtime's threshold, and the precision at ``recall_target`` (two passes)."""
    tp = predicted = 0
    fired_logits = []
    for i, logits in _logits(w1, w2, val_x):
        y = val_y[i : i + EVAL_BATCH]
        pred = chooses(logits, SPARSE_THRESHOLD)
        tp += int((pred & y).sum())
        predicted += int(pred.sum())
        fired_logits.append(logits[y])
    positives = int(val_y.sum())
    precision_at_target = 1.0
    if positives:
        # The cutoff that keeps ceil(target * positives) of the firing neurons' outputs.
        fired = xp.sort(xp.concatenate(fired_logits))
        cutoff = fired[positives - max(1, math.ceil(recall_target * positives))]
        above = sum(int((logits >= cutoff).sum()) for _, logits in _logits(w1, w2, val_x))
        precision_at_target = int((fired >= cutoff).sum()) / above
    return Quality(
        recall=tp / positives if positives else 1.0,
        precision=tp / predicted if predicted else 1.0,
        predicted_density=predicted / val_y.size,
        true_density=positives / val_y.size,
        precision_at_target=precision_at_target,
    )


def cannot_pass(curve: list[float], min_precision: float, epochs_left: int) -> bool:
    """The early-stop rule (module docstring) on the precision-at-target-recall curve, one value per epoch."""
    if len(curve) < 3:
        return False
    gain, previous_gain = curve[-1] - curve[-2], curve[-2] - curve[-3]
    return gain <= previous_gain + FLAT and curve[-1] + max(epochs_left, 0) * max(gain, 0.0) < min_precision


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
            g *= g
            v += (1 - b2) * g
            p -= scale * m / (v**0.5 + self.eps)


def gradients(xp, w1, w2, x, y, pos_weight: float) -> list:
    """Gradients of the class-weighted binary cross-entropy of ``logits = w2 · relu(w1 · x)``.

    The loss is ``-w·y·log p - (1-y)·log(1-p)`` with ``p = sigmoid(logits)``,
    summed over neurons and averaged over the batch; ``y`` is the bool fired mask.
    """
    hidden = hidden_layer(x @ w1.T)
    g = hidden @ w2.T  # the logits, overwritten with d(loss)/d(logits)
    if xp is np:
        from powerinfer_tools.predictors.logit_gradient import logit_gradient_inplace  # numba: loaded on use

        logit_gradient_inplace(g, y, pos_weight / len(x), 1 / len(x))
    else:
        prob = 0.5 * (1 + xp.tanh(0.5 * g))  # sigmoid without overflow
        g = xp.where(y, (pos_weight / len(x)) * (prob - 1), prob / len(x))
    g_hidden = (g @ w2) * (hidden > 0)
    return [g_hidden.T @ x, g.T @ hidden]


@dataclass
class Fit:
    hidden: int
    fc1: np.ndarray  # [hidden, d_model] float32, input scaling folded in
    fc2: np.ndarray  # [d_ff, hidden] float32
    quality: Quality  # on the tuning split: what steered the class weight and what the size search judges
    reported: Quality  # on the reporting split, which nothing was chosen on: what the predictor does on new rows
    pos_weight: float
    epochs: int
    stopped_early: bool  # by the early-stop rule: this size cannot pass

    @property
    def recall(self) -> float:
        return self.quality.recall

    @property
    def precision(self) -> float:
        return self.quality.precision


def fit_predictor(data: LayerPairs, hidden: int, settings: TrainSettings, xp, seed: tuple[int, ...]) -> Fit:
    """Train one MLP, steering the class weight until held-out recall reaches the target; stop
    early once the curve shows it cannot pass."""
    rng = np.random.default_rng(seed)
    d_model = data.train_x.shape[1]
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
    curve: list[float] = []
    while True:
        for _ in range(steps_per_epoch):
            x, y = data.batch(next(batches))
            opt.step(gradients(xp, w1, w2, xp.asarray(x), xp.asarray(y), pos_weight))
        quality = evaluate(xp, w1, w2, val_x, val_y, settings.recall)
        curve.append(quality.precision_at_target)
        short = quality.recall < settings.recall
        stop = ((short or quality.precision < settings.min_precision)
                and cannot_pass(curve, settings.min_precision, settings.epochs - len(curve)))
        if stop or (len(curve) >= settings.epochs
                    and (not short or len(curve) >= settings.epochs + settings.extra_epochs)):
            break
        if short:
            pos_weight *= settings.weight_up
        elif quality.recall > settings.recall + settings.recall_slack:
            pos_weight /= settings.weight_down
    reported = evaluate(xp, w1, w2, xp.asarray(data.report_x), xp.asarray(data.report_y), settings.recall)
    fc1 = _to_numpy(w1) / data.scale  # fc1 · (x / s) == (fc1 / s) · x: the runtime feeds raw inputs
    return Fit(hidden, fc1.astype(np.float32), _to_numpy(w2), quality, reported, pos_weight, len(curve), stop)


def _batches(rng: np.random.Generator, n: int, size: int):
    """Endless mini-batches of row indices, reshuffled every pass."""
    while True:
        order = rng.permutation(n)
        for i in range(0, n - size + 1, size):
            yield order[i : i + size]


def _to_numpy(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)
