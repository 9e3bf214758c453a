"""Rotary position embeddings' frequencies, with every scaling a supported family has: written once.

Both engines rotate with ``frequencies`` (the reference engine and the runtime's general path through
``models/layers.py`` ``rope_tables``, the compiled decoder with the same array): a rotation pair ``i`` of a
head turns by ``position * inverse_frequency[i]``, and cos and sin are multiplied by ``attention_factor``.
Transformers' ``ROPE_INIT_FUNCTIONS`` and llama.cpp's ``ggml_rope_ext`` define the scalings:

* ``linear``: every frequency divided by ``factor`` (positions interpolated);
* ``llama3`` (Llama 3.1 and 3.2): each frequency divided by its own factor, ``frequency_factors``: 1 for
  short wavelengths, ``factor`` for long ones, smoothly between. llama.cpp's converter stores them as the
  ``rope_freqs`` tensor; a config gives the parameters they are computed from (``llama3_factors``);
* ``yarn``: per pair, a ramp between the interpolated and the original frequency, by how many turns the pair
  makes within ``original_context``, and cos/sin scaled by 0.1 ln(factor) + 1. llama.cpp takes the ramp's
  ends (``beta_fast``, ``beta_slow``) and the scale from no GGUF key, so a config that sets them is refused
  (``models/base.py`` ``rope_settings``): their file would compute another model in llama.cpp;
* ``longrope`` (Phi-3-mini-128k, Phi-3.5-mini): each frequency divided by its own factor, from one of two lists,
  ``short_factors`` for a context window within ``original_context`` and ``long_factors`` beyond it, and cos/sin
  multiplied by ``attention_factor`` with either. llama.cpp's converter stores the lists as the
  ``rope_factors_short``/``rope_factors_long`` tensors.

Which longrope list a run rotates by is decided once, from the context window it is given (``context_size``:
the runtime's ``-c/--ctx-size``, by default the model's trained positions), as llama.cpp decides it: long factors
when the window is larger than ``original_context``. Every position of the run, prompt and generated, rotates
alike, so the keys already cached stay valid. transformers decides per forward pass, by the positions that pass
reaches (``max(position) + 1 > original_context``: long), keeping cached keys as they were rotated; the two agree
whenever a run's first forward pass (its prompt) and its window fall on the same side of ``original_context``
(docs/reference/supported-models.md).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np


class RopeKind(str, enum.Enum):
    """A scaling's name, as config.json's ``rope_type`` and GGUF's ``rope.scaling.type`` spell it."""

    NONE = "none"
    LINEAR = "linear"
    LLAMA3 = "llama3"
    YARN = "yarn"
    LONGROPE = "longrope"


# YaRN's ramp: pairs turning more often than YARN_BETA_FAST times within the original context keep their
# frequency, those turning fewer than YARN_BETA_SLOW times are interpolated fully (transformers' and llama.cpp's).
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0


@dataclass(frozen=True)
class RopeScaling:
    """How a model scales its rotary frequencies (``RopeKind``); the default scales nothing."""

    kind: RopeKind = RopeKind.NONE
    factor: float = 1.0
    frequency_factors: tuple[float, ...] | None = None  # llama3: a divisor per rotation pair
    original_context: int | None = None  # yarn, longrope: the context the model was trained at
    short_factors: tuple[float, ...] | None = None  # longrope: a divisor per rotation pair, within original_context
    long_factors: tuple[float, ...] | None = None  # longrope: the same beyond it
    attention_factor: float = 1.0  # longrope: what cos and sin are multiplied by

    def frequencies(self, theta: float, head_dim: int, context_size: int) -> tuple[np.ndarray, float]:
        """(inverse frequency of each rotation pair ``[head_dim / 2]`` in float64, what cos and sin are
        multiplied by) for rotary base ``theta``, in a run whose context window holds ``context_size``
        positions (longrope's choice of factors: the module's doc)."""
        inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        if self.kind is RopeKind.LINEAR:
            return inv_freq / self.factor, 1.0
        if self.kind is RopeKind.LLAMA3:
            return inv_freq / np.asarray(self.frequency_factors, dtype=np.float64), 1.0
        if self.kind is RopeKind.LONGROPE:
            return inv_freq / np.asarray(self.longrope_factors(context_size), dtype=np.float64), self.attention_factor
        if self.kind is RopeKind.YARN:
            return self._yarn(inv_freq, theta, head_dim)
        return inv_freq, 1.0

    def longrope_factors(self, context_size: int) -> tuple[float, ...]:
        """The longrope list a run with a window of ``context_size`` positions rotates by (llama.cpp's rule)."""
        return self.long_factors if context_size > self.original_context else self.short_factors

    def _yarn(self, inv_freq: np.ndarray, theta: float, head_dim: int) -> tuple[np.ndarray, float]:
        def pair_turning(turns: float) -> float:  # the (fractional) pair that turns ``turns`` times in the context
            return head_dim * math.log(self.original_context / (turns * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(pair_turning(YARN_BETA_FAST)), 0)
        high = min(math.ceil(pair_turning(YARN_BETA_SLOW)), head_dim - 1)
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / max(high - low, 0.001), 0.0, 1.0)
        kept = 1.0 - ramp  # the share of its own frequency a pair keeps
        mixed = inv_freq / self.factor * (1.0 - kept) + inv_freq * kept
        return mixed, 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


def llama3_factors(theta: float, head_dim: int, factor: float, low_freq_factor: float, high_freq_factor: float,
                   original_context: int) -> tuple[float, ...]:
    """Llama 3.1's divisor of each rotation pair's frequency (what llama.cpp's converter writes as ``rope_freqs``)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factors = []
    for wavelength in 2 * math.pi / inv_freq:
        if wavelength < original_context / high_freq_factor:
            factors.append(1.0)
        elif wavelength > original_context / low_freq_factor:
            factors.append(float(factor))
        else:
            smooth = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(factors)


def longrope_attention_factor(max_positions: int, original_context: int) -> float:
    """What longrope multiplies cos and sin by when a config does not say (transformers' default, and what
    llama.cpp's converter writes as ``rope.scaling.attn_factor``): sqrt(1 + ln(s) / ln(original_context)) for the
    extension s = max_positions / original_context, 1 for none."""
    extension = max_positions / original_context
    return math.sqrt(1 + math.log(extension) / math.log(original_context)) if extension > 1 else 1.0
