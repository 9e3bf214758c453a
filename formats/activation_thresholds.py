"""Training-free activation sparsity for SwiGLU and GeGLU models: the rules, their per-layer thresholds, and
how a model file stores them.

A SiLU FFN ``down(silu(gate x) * up x)`` has no exact zeros, but most of its activations are small; so has
Gemma's GeGLU, ``down(gelu(gate x) * up x)``. Two published rules skip the small ones without retraining:

- **CATS** (arXiv 2404.08763): neuron ``i`` is skipped when ``|act(gate_i x)|`` (SiLU, or GELU) is below the
  layer's threshold. The gate product stays dense (it decides); ``up`` and ``ffn_down_t`` are read only for the
  kept neurons, as for a ReLU model's firing ones.
- **TEAL** (ICLR 2025): an entry of a projection's input is dropped when its magnitude is below the
  threshold, so the weight column it multiplies is not read. We apply it to the FFN's two inputs: ``x``
  entering gate and up (``ffn_in``) and the intermediate ``h`` entering the down projection
  (``ffn_down``: a row of ``ffn_down_t``, the transposed storage sparse files already use).

``cats+teal`` is CATS, then TEAL on the down projection's input among the neurons CATS kept.

Thresholds are per layer, each set to the layer's quantile of its magnitudes on calibration text
(``profiling/calibration.py``): every layer at the target sparsity (the uniform allocation), or, chosen by
quality (``convert --max-quality-loss``, ``profiling/quality.py``), each layer at its own, the file then recording
how (``QualityChoice``). The reference
engine's ``models.layers.feed_forward`` computes the rule in NumPy: the definition the runtime's kernels
are tested against.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
# The metadata keys are spelled with our others (RULE_KEY: a SparsityRule value; TARGET_KEY: the sparsity the
# thresholds were calibrated for), and typed in formats/metadata_keys.py.
from powerinfer_tools.formats.constants import (SPARSITY_CURVE_PERPLEXITY_KEY, SPARSITY_CURVE_SPARSITY_KEY,
                                                SPARSITY_MAX_LOSS_KEY, SPARSITY_PERPLEXITY_KEY,
                                                SPARSITY_RULE_KEY as RULE_KEY, SPARSITY_TARGET_KEY as TARGET_KEY,
                                                SPARSITY_THRESHOLD_KEY)
from powerinfer_tools.formats.metadata_keys import read_key

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.xp import array_namespace


def threshold_key(name: str) -> str:
    """The float32 array (one value per layer) of one kind of threshold."""
    return SPARSITY_THRESHOLD_KEY.format(name=name)


class SparsityRule(str, enum.Enum):
    CATS = "cats"
    TEAL = "teal"
    CATS_TEAL = "cats+teal"

    @property
    def thresholds(self) -> tuple[str, ...]:
        """The ``LayerThresholds`` fields this rule sets."""
        return {SparsityRule.CATS: ("cats",), SparsityRule.TEAL: ("ffn_in", "ffn_down"),
                SparsityRule.CATS_TEAL: ("cats", "ffn_down")}[self]


@dataclass(frozen=True)
class LayerThresholds:
    """One layer's thresholds; None where its rule does not use one."""

    cats: Optional[float] = None  # on |act(gate x)|, per neuron (act: SiLU, or GeGLU's GELU)
    ffn_in: Optional[float] = None  # on |x| entering gate and up
    ffn_down: Optional[float] = None  # on |h| entering the down projection


@dataclass(frozen=True)
class QualityChoice:
    """How thresholds were chosen by quality: the relative perplexity increase over dense allowed, the held-out
    perplexity of the thresholds chosen, and the curve the choice was made on (overall sparsity and held-out
    perplexity of each point tried, the first dense)."""

    max_loss: float
    perplexity: float
    curve_sparsity: tuple[float, ...]
    curve_perplexity: tuple[float, ...]

    @property
    def loss(self) -> float:
        """The chosen thresholds' relative perplexity increase over dense."""
        return self.perplexity / self.curve_perplexity[0] - 1


@dataclass(frozen=True)
class ActivationThresholds:
    rule: SparsityRule
    target: float  # the sparsity the thresholds were calibrated for (the layers' mean), in [0, 1)
    layers: tuple[LayerThresholds, ...]
    choice: QualityChoice | None = None  # chosen by quality, rather than at a target given

    def add_to(self, writer) -> None:
        """Write into a ``GGUFWriter``'s metadata."""
        writer.add_string(RULE_KEY, self.rule.value)
        writer.add_float32(TARGET_KEY, self.target)
        for name in self.rule.thresholds:
            writer.add_array(threshold_key(name), [float(getattr(t, name)) for t in self.layers])
        if self.choice is not None:
            writer.add_float32(SPARSITY_MAX_LOSS_KEY, self.choice.max_loss)
            writer.add_float32(SPARSITY_PERPLEXITY_KEY, self.choice.perplexity)
            writer.add_array(SPARSITY_CURVE_SPARSITY_KEY, list(self.choice.curve_sparsity))
            writer.add_array(SPARSITY_CURVE_PERPLEXITY_KEY, list(self.choice.curve_perplexity))


def read_thresholds(get: Callable[[str], Any], n_layers: int, source: str) -> Optional[ActivationThresholds]:
    """The thresholds in a model file's metadata (``get``: its key lookup), or None when it has none.
    Errors name ``source``."""
    rule_name = read_key(get, RULE_KEY, source)
    if rule_name is None:
        return None
    try:
        rule = SparsityRule(rule_name)
    except ValueError:
        known = ", ".join(r.value for r in SparsityRule)
        raise PitoolsError(f"{source}: {RULE_KEY} is {rule_name!r:.40}; expected one of {known}") from None
    needed = f"rule {rule.value}"
    target = read_key(get, TARGET_KEY, source, required=needed)
    values = {name: read_key(get, threshold_key(name), source, n_layers, required=needed) for name in rule.thresholds}
    layers = tuple(LayerThresholds(**{name: float(v[i]) for name, v in values.items()}) for i in range(n_layers))
    return ActivationThresholds(rule, float(target), layers, _read_choice(get, source))


def _read_choice(get: Callable[[str], Any], source: str) -> QualityChoice | None:
    max_loss = read_key(get, SPARSITY_MAX_LOSS_KEY, source)
    if max_loss is None:
        return None
    needed = f"thresholds chosen by quality ({SPARSITY_MAX_LOSS_KEY})"
    sparsity = read_key(get, SPARSITY_CURVE_SPARSITY_KEY, source, required=needed)
    return QualityChoice(float(max_loss), float(read_key(get, SPARSITY_PERPLEXITY_KEY, source, required=needed)),
                         tuple(map(float, sparsity)), tuple(map(float, read_key(
                             get, SPARSITY_CURVE_PERPLEXITY_KEY, source, len(sparsity), required=needed))))


def clears(value, threshold):
    """The one test of every rule (CATS, TEAL): a value is kept where its magnitude is strictly above the
    threshold. Plain arithmetic, so that NumPy (or CuPy) applies it to arrays and the compiled decoder compiles
    it for one value (``runtime/thresholded_decode``), whose bounds on a CATS gate's products are bisected on it
    (``runtime/thresholded_ffn.cats_bounds``): a change here changes every path, calibration included."""
    return abs(value) > threshold


def kept(values: np.ndarray, threshold: Optional[float]) -> np.ndarray:
    """Which entries a threshold keeps (``clears`` it; all, without one)."""
    if threshold is None:
        return array_namespace(values).ones(values.shape, dtype=bool)  # NumPy, or CuPy on a device
    return clears(values, threshold)


def thresholded(values: np.ndarray, threshold: Optional[float]) -> np.ndarray:
    """``values`` with the entries a threshold does not keep (``kept``) set to 0; ``values`` itself without one."""
    return values if threshold is None else only(values, kept(values, threshold))


def only(values: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """``values`` where ``keep``, else 0, as a product with the mask: ``where`` branches on each entry and
    mispredicts a rule's scattered choice (several times the product's time on 128 x 1536 float32). The two differ
    only at a NaN or infinite value dropped (NaN here, 0 there)."""
    return values * keep
