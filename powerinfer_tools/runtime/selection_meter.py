"""How a choice of FFN neurons compares with the neurons that truly fire: the counts behind recall.

Both engines fill one: the reference engine's ``neuron_selector`` (``profiling/perplexity.py``) and the
runtime's ``RuntimeModel.firing_meter`` (``pitools bench``'s quality pass, off the clock).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SelectionMeter:
    """Per layer: (token, neuron) pairs seen, computed, truly firing, and both."""

    seen: np.ndarray
    computed: np.ndarray
    fired: np.ndarray
    hit: np.ndarray

    @classmethod
    def zeros(cls, n_layers: int) -> SelectionMeter:
        return cls(*(np.zeros(n_layers, np.int64) for _ in range(4)))

    def add(self, layer: int, selected: np.ndarray, fired: np.ndarray) -> None:
        self.seen[layer] += selected.size
        self.computed[layer] += int(selected.sum())
        self.fired[layer] += int(fired.sum())
        self.hit[layer] += int((selected & fired).sum())

    def summary(self) -> dict:
        def ratio(a, b):
            return float(a.sum() / max(b.sum(), 1))

        return {
            "computed_density": ratio(self.computed, self.seen),
            "fired_density": ratio(self.fired, self.seen),
            "recall": ratio(self.hit, self.fired),
            "layers": [
                {"layer": i, "computed_density": ratio(self.computed[i], self.seen[i]),
                 "fired_density": ratio(self.fired[i], self.seen[i]), "recall": ratio(self.hit[i], self.fired[i])}
                for i in range(len(self.seen))
            ],
        }
