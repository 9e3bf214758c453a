"""Sparsity chosen by quality (``pitools convert --max-quality-loss``): a SiLU model's per-layer sparsity as high
as held-out perplexity allows.

1. The last fifth of the calibration tokens (at most ``HELD_OUT_TOKENS``) is held out: no threshold is set on
   it; it only measures perplexity (``held_out_split``).
2. Sensitivity (``sensitivity``): the dense model runs the first ``SENSITIVITY_TOKENS`` of the rest; each layer's
   FFN is computed again at every sparsity of ``GRID`` (thresholds at that quantile of the window's own
   magnitudes), and the cost of each is the squared error of the FFN's output relative to its squared dense
   output. (Relative to the residual stream it is added to instead, SmolLM2's middle layers, whose stream is
   large, looked cheap and took 80%: +120% perplexity at 40% overall, uniform +12%.) The same run samples each
   layer's magnitudes for the thresholds of step 4.
3. Allocation (``allocate``, greedy as TEAL's): from every layer dense, the layer whose cost rises least is
   raised by one ``GRID`` step, again and again, until the layers' mean reaches the point's sparsity.
4. Each point of ``POINTS`` is measured by held-out perplexity with the greedy allocation and with the uniform
   one (every layer at the point), thresholds at the quantiles of step 2's samples on the dense model; the
   better of the two is the point's: the quality-vs-sparsity curve, never worse than uniform.
5. The sparsest point within the limit is calibrated (``calibration.calibrate`` at its per-layer targets: each
   layer's magnitudes on inputs from the thresholded layers before it, and the neuron frequencies) and its
   held-out perplexity measured again; should that break the limit, the next denser point within it is.

The file records the limit, the chosen thresholds' held-out perplexity and the curve
(``formats/activation_thresholds.QualityChoice``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.activation_thresholds import (
    ActivationThresholds,
    QualityChoice,
    SparsityRule,
)
from powerinfer_tools.interfaces import tracing
from powerinfer_tools.models import DecoderModel
from powerinfer_tools.models.layers import FFNTrace, feed_forward, linear
from powerinfer_tools.profiling.calibration import (
    Calibration,
    CalibrationSettings,
    Sampler,
    calibrate,
    check_thresholdable,
    layer_thresholds,
)
from powerinfer_tools.profiling.perplexity import perplexity
from powerinfer_tools.profiling.profiler import windows_of
from powerinfer_tools.progress import progress_bar

GRID = tuple(round(0.1 * k, 1) for k in range(9))  # the per-layer sparsities an allocation moves between
POINTS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)  # the overall sparsities of the curve
HELD_OUT_TOKENS = 2048  # paired with dense on the same tokens: differences well below a 5% limit stand out
SENSITIVITY_TOKENS = 512  # two windows: each layer's error curve and its 786,432 gate magnitudes (SmolLM2)
MIN_HELD_OUT = 32


def held_out_split(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the tokens thresholds are set on, the tokens held out to measure perplexity)."""
    held = min(HELD_OUT_TOKENS, len(tokens) // 5)
    if held < MIN_HELD_OUT:
        raise PitoolsError(f"--max-quality-loss holds a fifth of the calibration tokens out to measure perplexity: "
                           f"it needs at least {5 * MIN_HELD_OUT} tokens, not {len(tokens)}")
    return tokens[:-held], tokens[-held:]


@dataclass(frozen=True)
class Sensitivity:
    costs: np.ndarray  # [n_layers, len(GRID)]: the relative output error at each sparsity, non-decreasing
    samplers: list[Sampler]  # each layer's magnitudes on the dense model


def sensitivity(model: DecoderModel, tokens: np.ndarray, rule: SparsityRule, seq_len: int,
                rng: np.random.Generator, progress: bool) -> Sensitivity:
    """Each layer's cost at every sparsity of ``GRID`` and its magnitudes, from ``model`` run dense on the first
    ``SENSITIVITY_TOKENS`` of ``tokens``."""
    spec = model.spec
    windows = windows_of(tokens[:SENSITIVITY_TOKENS], seq_len)
    samplers = [Sampler.of(rule, spec, sum(map(len, windows)), rng) for _ in range(spec.n_layers)]
    errors, scale = np.zeros((spec.n_layers, len(GRID))), np.zeros(spec.n_layers)

    def hook(trace: FFNTrace) -> None:
        samplers[trace.layer].add(trace)
        own = Sampler.of(rule, spec, len(trace.ffn_input), rng)
        own.add(trace)
        weights = model.blocks[trace.layer].ffn
        dense = linear(trace.activated, weights.down, weights.down_bias)
        for k, sparsity in enumerate(GRID[1:], 1):
            sparse = feed_forward(spec.ffn, weights, trace.ffn_input, trace.layer,
                                  thresholds=layer_thresholds(own, rule, sparsity))
            errors[trace.layer, k] += float(np.sum((sparse - dense) ** 2))
        scale[trace.layer] += float(np.sum(dense ** 2))

    tokens_run = sum(map(len, windows))
    with progress_bar(total=tokens_run, desc="sensitivity", unit="tok", enabled=progress) as bar, tracing(model, hook):
        for window in windows:
            model.forward(window, model.new_cache())
            bar.update(len(window))
    return Sensitivity(np.maximum.accumulate(errors / scale[:, None], axis=1), samplers)


def allocate(costs: np.ndarray, sparsity: float) -> tuple[float, ...]:
    """Per-layer sparsities of ``GRID`` whose mean reaches ``sparsity`` (at most ``GRID``'s top), raised one step
    at a time where the cost (``costs[layer, step]``) rises least."""
    steps, top, rows = np.zeros(len(costs), int), len(GRID) - 1, np.arange(len(costs))
    grid = np.asarray(GRID)
    while grid[steps].mean() < min(sparsity, GRID[-1]) - 1e-9:
        rise = np.where(steps < top, costs[rows, np.minimum(steps + 1, top)] - costs[rows, steps], np.inf)
        steps[np.argmin(rise)] += 1
    return tuple(float(grid[s]) for s in steps)


def choose_sparsity(model: DecoderModel, tokens: np.ndarray, rule: SparsityRule, max_loss: float, seq_len: int,
                    seed: int = 0, progress: bool = True) -> Calibration:
    """The thresholds of the sparsest point of ``POINTS`` whose held-out perplexity is at most ``1 + max_loss``
    times dense, calibrated on the rest of ``tokens``; they carry the curve (``QualityChoice``)."""
    spec = model.spec
    check_thresholdable(spec)
    seq_len = min(seq_len, spec.max_positions)
    calibration_tokens, held = held_out_split(np.asarray(tokens))
    rng = np.random.default_rng(seed)
    found = sensitivity(model, calibration_tokens, rule, seq_len, rng, progress)

    def held_out_perplexity(thresholds: ActivationThresholds | None, name: str) -> float:
        return perplexity(model, held, seq_len, name, progress=progress, thresholds=thresholds).perplexity

    def measured(point: float, allocation: tuple[float, ...], name: str) -> tuple[float, tuple[float, ...]]:
        thresholds = tuple(layer_thresholds(sampler, rule, t) for sampler, t in zip(found.samplers, allocation))
        return held_out_perplexity(ActivationThresholds(rule, point, thresholds), f"{rule.value} at {point:.0%}, {name}"
                                   ), allocation

    dense = held_out_perplexity(None, "dense")
    limit = dense * (1 + max_loss)
    best = {point: min(measured(point, allocation, name) for name, allocation in
                       {"greedy": allocate(found.costs, point), "uniform": (point,) * spec.n_layers}.items())
            for point in POINTS}
    allocations = {point: allocation for point, (_, allocation) in best.items()}
    curve = [(0.0, dense)] + [(point, value) for point, (value, _) in best.items()]
    shown = ", ".join(f"{point:.0%}: {value:.3f}" for point, value in curve)
    for point in sorted((p for p, value in curve[1:] if value <= limit), reverse=True):
        calibration = calibrate(model, calibration_tokens, CalibrationSettings(point, rule, seq_len, seed,
                                                                               allocations[point]), progress)
        chosen = held_out_perplexity(calibration.thresholds, f"{rule.value} at {point:.0%}, calibrated")
        if chosen <= limit:
            choice = QualityChoice(max_loss, chosen, tuple(p for p, _ in curve), tuple(v for _, v in curve))
            return replace(calibration, thresholds=replace(calibration.thresholds, choice=choice))
    raise PitoolsError(f"no sparsity keeps held-out perplexity within {max_loss:.1%} of dense ({shown}); allow "
                       "more loss with --max-quality-loss, or convert with --dense")


def describe(thresholds: ActivationThresholds) -> list[str]:
    """The report of thresholds chosen by quality: the curve and the point chosen."""
    choice = thresholds.choice
    dense = choice.curve_perplexity[0]
    lines = [(f"held-out perplexity by sparsity ({thresholds.rule.value}, the better of the greedy and the uniform "
              f"allocation; dense {dense:.3f}):")]
    lines += [f"  {s:4.0%}  {p:8.3f}  {p / dense - 1:+7.2%}" for s, p in
              zip(choice.curve_sparsity[1:], choice.curve_perplexity[1:])]
    lines.append(f"chose {thresholds.target:.0%} sparsity within {choice.max_loss:.1%}: calibrated, held-out "
                 f"perplexity {choice.perplexity:.3f} ({choice.loss:+.2%})")
    return lines
