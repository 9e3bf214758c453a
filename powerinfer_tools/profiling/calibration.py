"""Calibrating training-free sparsity thresholds (CATS, TEAL) of a SiLU or GeGLU model on calibration text.

One layer-major pass of the reference engine: every calibration window is run through layer 0, then
through layer 1, and so on, each window's residual stream kept between layers (``DecoderModel.stages``).
At layer ``L``:

1. a spread subset of the windows (at most ``SAMPLE_TOKENS`` tokens, the first window among them) runs
   layer ``L`` dense, and its magnitudes (``|act(gate x)|``, ``|x|`` entering the FFN, ``|h|`` entering
   its down projection) are sampled; each threshold the rule needs is set to the layer's quantile at its
   target sparsity. ``cats+teal``'s down threshold is the quantile among the neurons CATS keeps (the two
   kinds are sampled at the same positions); TEAL's, of ``h`` computed from layer ``L``'s dense input;
2. every window runs layer ``L`` with those thresholds, which gives layer ``L + 1`` its input, and each
   neuron's share of tokens whose rows it reads is counted (the frequencies ``pitools solve`` places
   neurons by).

A layer's magnitudes are thus sampled on inputs that come from the thresholded layers before it, as they
will at run time, so that the target holds there too (on the dense model's thresholds alone, the share
computed drifts above the target). The output head is never computed.

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
from powerinfer_tools.formats.model_spec import FFNUnit, ModelSpec
from powerinfer_tools.interfaces import tracing
from powerinfer_tools.models import DecoderModel
from powerinfer_tools.models.layers import FFNTrace, gate_activation
from powerinfer_tools.profiling.profiler import windows_of
from powerinfer_tools.progress import progress_bar

SAMPLES = 1 << 18  # magnitudes kept per layer and kind for the quantiles
# Tokens whose magnitudes set each layer's thresholds (whole windows spread over the calibration text): at
# SmolLM2's widths 12.6 M gate magnitudes a layer, where the quantile no longer moves; running them twice
# costs SAMPLE_TOKENS / (calibration tokens) of a pass (a sixth at the default 50,000).
SAMPLE_TOKENS = 8192


@dataclass(frozen=True)
class CalibrationSettings:
    target_sparsity: float  # every layer's; with ``layer_targets``, their mean (what the file records)
    rule: SparsityRule = SparsityRule.CATS
    seq_len: int = 256
    seed: int = 0
    layer_targets: tuple[float, ...] | None = None  # one per layer: an allocation (profiling/quality.py)

    def __post_init__(self):
        if not all(0 <= t < 1 for t in (self.target_sparsity, *(self.layer_targets or ()))):
            raise PitoolsError(f"--target-sparsity must be in [0, 1), got {self.target_sparsity}")

    def targets(self, n_layers: int) -> tuple[float, ...]:
        if self.layer_targets is None:
            return (self.target_sparsity,) * n_layers
        if len(self.layer_targets) != n_layers:
            raise PitoolsError(f"{len(self.layer_targets)} layer targets for a model of {n_layers} layers")
        return self.layer_targets


@dataclass(frozen=True)
class Calibration:
    """What a converter writes for a thresholded model."""

    thresholds: ActivationThresholds
    frequencies: dict[FFNUnit, np.ndarray]  # per neuron: share of calibration tokens reading its rows
    tokens: int


class Sampler:
    """A uniform random subset of one layer's magnitudes of each kind, at most ``SAMPLES`` (expected). Kinds of
    the same width are sampled at the same positions, so that one can be read conditionally on another."""

    @classmethod
    def of(cls, rule: SparsityRule, spec: ModelSpec, n_tokens: int, rng: np.random.Generator) -> Sampler:
        """A sampler of the magnitudes ``rule``'s thresholds are set from, over ``n_tokens`` of ``spec``'s model."""
        widths = {"cats": spec.d_ff, "ffn_in": spec.d_model, "ffn_down": spec.d_ff}
        return cls(n_tokens, {kind: widths[kind] for kind in rule.thresholds}, rng, gate_activation(spec.ffn))

    def __init__(self, n_tokens: int, widths: dict[str, int], rng: np.random.Generator, activation):
        self.widths, self.rng, self.activation = widths, rng, activation
        self.rate = {width: min(1.0, SAMPLES / (n_tokens * width)) for width in set(widths.values())}
        self.samples: dict[str, list[np.ndarray]] = {kind: [] for kind in widths}

    def add(self, trace: FFNTrace) -> None:
        """An ``FFNHook``: the magnitudes of ``trace``'s tokens."""
        every = {"cats": lambda: self.activation(trace.gate_pre), "ffn_in": lambda: trace.ffn_input,
                 "ffn_down": lambda: trace.activated}
        masks = {width: self.rng.random((len(trace.ffn_input), width)) < rate for width, rate in self.rate.items()}
        for kind, width in self.widths.items():
            self.samples[kind].append(np.abs(every[kind]()[masks[width]]).astype(np.float32))

    def values(self, kind: str) -> np.ndarray:
        return np.concatenate(self.samples[kind])


def _quantile(values: np.ndarray, q: float) -> float:
    # nothing of a kind survived the earlier rule (cats+teal at a high CATS target): no further sparsity to find
    return float(np.quantile(values, q)) if values.size else 0.0


def layer_thresholds(sampler: Sampler, rule: SparsityRule, target: float) -> LayerThresholds:
    """One layer's thresholds for ``rule`` at ``target``, from its sampled magnitudes."""
    if rule is SparsityRule.CATS_TEAL:
        cats = _quantile(sampler.values("cats"), target)
        down = sampler.values("ffn_down")[sampler.values("cats") > cats]
        return LayerThresholds(cats=cats, ffn_down=_quantile(down, target))
    return LayerThresholds(**{kind: _quantile(sampler.values(kind), target) for kind in rule.thresholds})


def check_thresholdable(spec: ModelSpec) -> None:
    if spec.ffn.sparse or spec.moe:
        raise PitoolsError(f"thresholded sparsity (--target-sparsity) is for SiLU (SwiGLU) and GELU (GeGLU) models "
                           f"without experts; this model's FFN is {spec.ffn.value}{' with experts' if spec.moe else ''}")


def calibrate(model: DecoderModel, tokens: np.ndarray, settings: CalibrationSettings,
              progress: bool = True) -> Calibration:
    """Thresholds for ``settings.rule`` at ``settings.target_sparsity`` (each layer at its ``layer_targets``) from
    ``model`` (a reference engine) run on ``tokens``, and the neuron frequencies they give."""
    spec = model.spec
    check_thresholdable(spec)
    if len(tokens) == 0:
        raise PitoolsError("no calibration tokens")
    rule, target, layer_targets = settings.rule, settings.target_sparsity, settings.targets(spec.n_layers)
    windows = windows_of(np.asarray(tokens), min(settings.seq_len, spec.max_positions))
    sampled = np.unique(np.linspace(0, len(windows) - 1, min(len(windows), -(-SAMPLE_TOKENS // len(windows[0])))
                                    ).round().astype(int))
    sampled_tokens = sum(len(windows[i]) for i in sampled)
    rng = np.random.default_rng(settings.seed)
    # Each window is run from an empty sequence once per layer (twice where sampled): no key or value is needed
    # beyond the call that makes it, so none is kept (a cache for all windows would be ~12 MB each at SmolLM2's).
    stages = [model.stages(window, _CallCache()) for window in windows]
    streams = [s.embedded for s in stages]
    layers = [LayerThresholds()] * spec.n_layers  # dense until calibrated
    counts = np.zeros((spec.n_layers, spec.d_ff), np.int64)
    activation = gate_activation(spec.ffn)

    def count_read(trace: FFNTrace) -> None:
        t = layers[trace.layer]
        # the rows a token reads: CATS's kept neurons' up rows; under TEAL alone, the down rows
        counts[trace.layer] += (kept(trace.activated, t.ffn_down) if rule is SparsityRule.TEAL
                                else kept(activation(trace.gate_pre), t.cats)).sum(axis=0)

    with progress_bar(total=spec.n_layers, desc="calibrate", unit="layer", enabled=progress) as bar:
        for layer in range(spec.n_layers):
            sampler = Sampler.of(rule, spec, sampled_tokens, rng)
            with tracing(model, sampler.add, ActivationThresholds(rule, target, tuple(layers))):
                for i in sampled:
                    stages[i].layers[layer](streams[i])
            layers[layer] = layer_thresholds(sampler, rule, layer_targets[layer])
            with tracing(model, count_read, ActivationThresholds(rule, target, tuple(layers))):
                streams = [s.layers[layer](x) for s, x in zip(stages, streams)]
            bar.update(1)
    frequencies = {FFNUnit(layer): counts[layer] / len(tokens) for layer in range(spec.n_layers)}
    return Calibration(ActivationThresholds(rule, target, tuple(layers)), frequencies, len(tokens))


class _CallCache:
    """The cache of a sequence computed in one call from its start and never continued: each layer attends to
    that call's keys and values alone, so nothing is stored (``KVCache``'s ``length`` and ``store``)."""

    length = 0

    @staticmethod
    def store(layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return k, v
