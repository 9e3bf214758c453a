"""Perplexity, dense or computing only some FFN neurons: of a checkpoint on the reference engine
(``perplexity``) or of a GGUF file on the runtime (``runtime_perplexity``).

The modes are the engines' ``FFNMode``. On the reference engine, the modes other than dense
restrict each FFN through its ``neuron_selector``: ``oracle`` computes exactly the neurons that
fire (so it must equal dense up to rounding), ``sparse`` the neurons the trained predictors
select, as the sparse runtime would. Both also measure, per layer, the fraction of neurons
computed and the recall: of the neurons that truly fire, the share computed. On the runtime
``sparse`` runs the file's own predictors, metered alike (``RuntimeModel.firing_meter``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from powerinfer_tools.formats.activation_thresholds import ActivationThresholds
from powerinfer_tools.formats.predictor_rule import predict
from powerinfer_tools.formats.profile_folder import predictor_input
from powerinfer_tools.interfaces import Engine, FFNMode
from powerinfer_tools.models import DecoderModel
from powerinfer_tools.progress import progress_bar
from powerinfer_tools.runtime.engine import RuntimeModel, TokenStats
from powerinfer_tools.runtime.selection_meter import SelectionMeter


Chooser = Callable[[int, np.ndarray, np.ndarray], np.ndarray]  # (layer, residual, fired) -> neurons to compute


def oracle_chooser() -> Chooser:
    return lambda layer, residual, fired: fired


def predictor_chooser(threshold: float, predictors: list[tuple[np.ndarray, np.ndarray]]) -> Chooser:
    def choose(layer: int, residual: np.ndarray, fired: np.ndarray) -> np.ndarray:
        fc1, fc2 = predictors[layer]
        return predict(fc1, fc2, predictor_input(residual), threshold)

    return choose


def metered_selector(choose: Chooser, meter: SelectionMeter):
    """A ``neuron_selector`` that applies ``choose`` and records how it compares with the true firing."""

    def select(layer: int, residual: np.ndarray, fired: np.ndarray) -> np.ndarray:
        selected = choose(layer, residual, fired)
        meter.add(layer, selected, fired)
        return selected

    return select


@dataclass
class PerplexityResult:
    mode: str
    perplexity: float
    mean_nll: float
    scored_tokens: int
    selection: dict | None = None  # SelectionMeter.summary() in the sparse modes

    def as_dict(self) -> dict:
        return {"mode": self.mode, "perplexity": self.perplexity, "mean_nll": self.mean_nll,
                "scored_tokens": self.scored_tokens, "selection": self.selection}


def perplexity(model: DecoderModel, tokens: np.ndarray, seq_len: int, mode: str = FFNMode.DENSE.value,
               choose: Chooser | None = None, progress: bool = True,
               thresholds: ActivationThresholds | None = None) -> PerplexityResult:
    """Perplexity of the reference engine, computing the FFN neurons ``choose`` picks (all when None), or running a
    SiLU model's ``thresholds``; ``mode`` names the result (an ``FFNMode`` word, or any other name)."""
    meter = SelectionMeter.zeros(model.spec.n_layers) if choose is not None else None
    model.neuron_selector = metered_selector(choose, meter) if choose is not None else None
    model.activation_thresholds = thresholds
    try:
        mean, scored = _mean_nll(model, tokens, seq_len, mode, progress)
    finally:
        model.neuron_selector = model.activation_thresholds = None
    return PerplexityResult(mode, math.exp(mean), mean, scored, meter.summary() if meter is not None else None)


def runtime_perplexity(model: RuntimeModel, tokens: np.ndarray, seq_len: int, mode: str = FFNMode.DENSE.value,
                       progress: bool = True) -> PerplexityResult:
    """Perplexity of a GGUF file on the runtime in ``mode``, an ``FFNMode`` word (``sparse``: the file's own
    predictors), which names the result.

    In sparse mode the runtime's ``firing_meter`` also computes every neuron beside the predicted ones, so
    the recall is reported as on the reference engine; not under a RAM budget (the cold rows are not all
    in memory) nor for thresholds (no firing to miss), where only the fraction computed is.
    """
    model.mode = FFNMode(mode)
    model.stats = TokenStats()
    metered = model.mode is FFNMode.SPARSE and model.can_meter_firing
    model.firing_meter = SelectionMeter.zeros(len(model.layers)) if metered else None
    try:
        mean, scored = _mean_nll(model, tokens, seq_len, mode, progress)
        selection = model.firing_meter.summary() if metered else None
    finally:
        model.firing_meter = None
    if model.mode is not FFNMode.DENSE:
        selection = (selection or {}) | {"computed_density": model.stats.density}
    return PerplexityResult(mode, math.exp(mean), mean, scored, selection)


def _mean_nll(model: Engine, tokens: np.ndarray, seq_len: int, mode: str, progress: bool) -> tuple[float, int]:
    """Mean next-token NLL over windows of ``seq_len`` inputs, each run by ``model`` from an empty cache,
    and the number of tokens scored.

    Window ``k`` reads tokens ``k·L .. k·L+L-1`` and is scored on the tokens one
    further on, so every token but the first is scored exactly once.
    """
    total_nll, scored = 0.0, 0
    with progress_bar(total=len(tokens) - 1, unit="tok", desc=f"perplexity ({mode})", enabled=progress) as bar:
        for start in range(0, len(tokens) - 1, seq_len):
            targets = tokens[start + 1 : start + seq_len + 1]
            logits = model.forward(tokens[start : start + len(targets)], model.new_cache())
            total_nll -= float(log_probabilities(logits)[np.arange(len(targets)), targets].sum())
            scored += len(targets)
            bar.update(len(targets))
    return total_nll / scored, scored


def format_result(result: PerplexityResult) -> str:
    text = f"perplexity {result.perplexity:.4f} ({result.mode}) over {result.scored_tokens} tokens"
    s = result.selection
    if s is not None:
        text += f"; computed {s['computed_density']:.1%} of FFN neurons"
        if "recall" in s:
            text += f", {s['fired_density']:.1%} fire, recall {s['recall']:.2%}"
    return text


def log_probabilities(logits: np.ndarray) -> np.ndarray:
    """Each row's log-softmax ``[T, vocab]``, in float64."""
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
