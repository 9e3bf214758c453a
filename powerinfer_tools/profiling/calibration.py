"""Calibrating training-free sparsity thresholds (CATS, TEAL) of a SiLU model on calibration text.

Three passes of the reference engine over the calibration tokens:

1. on the dense model, each layer's magnitudes (``|silu(gate x)|``, ``|x|`` entering the FFN, ``|h|``
   entering its down projection) are sampled and every threshold its rule needs is set to the
   layer's quantile at the target sparsity: every layer equally sparse (the uniform allocation);
2. the same on the model running those thresholds: a layer's inputs then come from sparsified
   layers before it, as they will at run time, so that the target holds there too (on the dense
   model's thresholds alone, the share computed drifts above the target). ``cats+teal``'s down
   threshold is set here, among the neurons CATS keeps;
3. with the final thresholds, each neuron's share of tokens whose rows it reads is counted (the
   frequencies ``pitools solve`` places neurons by).

Samples are a uniform random subset of at most ``SAMPLES`` magnitudes per layer and kind: a quantile's
error from sampling is then below 0.1 percentage point of sparsity.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.activation_thresholds import (
    ActivationThresholds,
    LayerThresholds,
    SparsityRule,
    kept,
)
from powerinfer_tools.formats.model_spec import FFNKind, FFNUnit
from powerinfer_tools.interfaces import FFNTracer, tracing
from powerinfer_tools.models.layers import FFNTrace, silu
from powerinfer_tools.profiling.profiler import windows_of
from powerinfer_tools.progress import progress_bar

SAMPLES = 1 << 18  # magnitudes kept per layer and kind for the quantiles


@dataclass(frozen=True)
class CalibrationSettings:
    target_sparsity: float
    rule: SparsityRule = SparsityRule.CATS
    seq_len: int = 256
    seed: int = 0

    def __post_init__(self):
        if not 0 <= self.target_sparsity < 1:
            raise PitoolsError(f"--target-sparsity must be in [0, 1), got {self.target_sparsity}")


@dataclass(frozen=True)
class Calibration:
    """What a converter writes for a thresholded model."""

    thresholds: ActivationThresholds
    frequencies: dict[FFNUnit, np.ndarray]  # per neuron: share of calibration tokens reading its rows
    tokens: int


def _sample(model: FFNTracer, windows: list[np.ndarray], settings: CalibrationSettings,
            running: ActivationThresholds | None, pass_name: str, progress: bool) -> list[dict]:
    """Each layer's quantiles, at the target, of the magnitudes its rule thresholds, sampled with the
    model running ``running`` (dense without). ``cats+teal``'s down threshold needs a CATS threshold to be
    conditional on: ``running``'s (None on the dense model)."""
    spec, rule = model.spec, settings.rule
    widths = {"cats": spec.d_ff, "ffn_in": spec.d_model, "ffn_down": spec.d_ff}
    sampler = _Sampler(sum(len(w) for w in windows), widths, settings.seed + (running is not None))

    def hook(trace: FFNTrace) -> None:
        cats = np.abs(silu(trace.gate_pre))
        values = {"cats": cats, "ffn_in": np.abs(trace.ffn_input), "ffn_down": np.abs(trace.activated)}
        if rule is SparsityRule.CATS_TEAL:  # the down projection's input among the neurons CATS keeps
            values["ffn_down"] = values["ffn_down"][cats > running.layers[trace.layer].cats] if running else None
        for kind in rule.thresholds:
            if values[kind] is not None:
                sampler.add(trace.layer, kind, values[kind])

    _run(model, windows, hook, running, pass_name, progress)
    return [{kind: sampler.quantile(layer, kind, settings.target_sparsity) if sampler.has(layer, kind) else None
             for kind in rule.thresholds} for layer in range(spec.n_layers)]


class _Sampler:
    """A uniform random subset of each layer's magnitudes of each kind, at most ``SAMPLES`` (expected)."""

    def __init__(self, n_tokens: int, widths: dict[str, int], seed: int):
        self.rate = {kind: min(1.0, SAMPLES / (n_tokens * width)) for kind, width in widths.items()}
        self.rng = np.random.default_rng(seed)
        self.samples: dict[tuple[int, str], list[np.ndarray]] = {}

    def add(self, layer: int, kind: str, values: np.ndarray) -> None:
        flat = values.ravel()
        chosen = flat[self.rng.random(flat.shape[0]) < self.rate[kind]]
        self.samples.setdefault((layer, kind), []).append(chosen.astype(np.float32))

    def has(self, layer: int, kind: str) -> bool:
        return (layer, kind) in self.samples

    def quantile(self, layer: int, kind: str, q: float) -> float:
        values = np.concatenate(self.samples[layer, kind])
        if values.size == 0:  # nothing of that kind survived the earlier rule: no further sparsity to find
            return 0.0
        return float(np.quantile(values, q))


def _run(model: FFNTracer, windows: list[np.ndarray], hook, running: ActivationThresholds | None, desc: str,
         progress: bool) -> None:
    with progress_bar(total=sum(len(w) for w in windows), desc=desc, unit="tok", enabled=progress) as bar:
        with tracing(model, hook, running):
            for window in windows:
                model.forward(window, model.new_cache())
                bar.update(len(window))


def calibrate(model: FFNTracer, tokens: np.ndarray, settings: CalibrationSettings,
              progress: bool = True) -> Calibration:
    """Thresholds for ``settings.rule`` at ``settings.target_sparsity`` from ``model`` (a reference engine)
    run on ``tokens``, and the neuron frequencies they give."""
    spec = model.spec
    if spec.ffn is not FFNKind.SWIGLU or spec.moe:
        raise PitoolsError(f"thresholded sparsity (--target-sparsity) is for SiLU (SwiGLU) models without experts; "
                           f"this model's FFN is {spec.ffn.value}{' with experts' if spec.moe else ''}")
    if len(tokens) == 0:
        raise PitoolsError("no calibration tokens")
    windows = windows_of(np.asarray(tokens), min(settings.seq_len, spec.max_positions))
    rule, q = settings.rule, settings.target_sparsity

    def thresholds(layers: list[dict]) -> ActivationThresholds:
        return ActivationThresholds(rule, q, tuple(LayerThresholds(**values) for values in layers))

    dense = thresholds(_sample(model, windows, settings, None, "calibrate (1/3)", progress))
    final = thresholds(_sample(model, windows, settings, dense, "calibrate (2/3)", progress))
    counts = np.zeros((spec.n_layers, spec.d_ff), np.int64)

    def count_read(trace: FFNTrace) -> None:
        t = final.layers[trace.layer]
        # the rows a token reads: CATS's kept neurons' up rows; under TEAL alone, the down rows
        counts[trace.layer] += (kept(trace.activated, t.ffn_down) if rule is SparsityRule.TEAL
                                else kept(silu(trace.gate_pre), t.cats)).sum(axis=0)

    _run(model, windows, count_read, final, "calibrate (3/3)", progress)
    frequencies = {FFNUnit(layer): counts[layer] / len(tokens) for layer in range(spec.n_layers)}
    return Calibration(final, frequencies, len(tokens))
