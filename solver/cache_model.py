"""How often a layer's neuron cache misses: the expected disk reads per token of an LRU cache.

The runtime (``pitools run --ram``, ``runtime/neuron_cache.py``) gives each layer its own cache of
``slots`` rows for the neurons it reads from disk. Each token the layer asks for the neurons that fire,
all at once: those in a slot are hits, the others are read into the slots used longest ago. Neuron
``i`` fires on a token with probability ``p[i]``, independently of the others and of earlier tokens
(the profile's firing frequencies: an independent-reference model).

Che's approximation: an LRU cache holds what was used within its characteristic time ``T`` (in
tokens), the time in which ``slots`` distinct neurons are used, ``sum_i (1 - exp(-p[i] T)) = slots``;
neuron ``i`` hits with probability ``1 - exp(-p[i] T)``, so a token's expected misses are
``sum_i p[i] exp(-p[i] T)``. ``T`` is found on a geometric grid (ratio 2^(1/8)), the sums linearly
interpolated between its points. Against a simulation of the runtime's cache (tests/test_solver_ram.py)
the predicted hit rate is within a few percent for caches of a token's firings or more; smaller
caches, which one token's misses overflow (the runtime then loads them in chunks that evict each
other), hit rarely and are predicted roughly.
"""

from __future__ import annotations

import numpy as np

# Characteristic times (tokens) T is looked for among: 0, then 2^-10 to 2^30, ratio 2^(1/8).
_T_GRID = np.concatenate(([0.0], 2.0 ** (np.arange(-10 * 8, 30 * 8 + 1) / 8)))


def _from_end(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``out[i, ...] = values[starts[i]:].sum(0)`` for every start (``len`` included): sums from the end."""
    sums = np.cumsum(values[::-1], axis=0)  # sums[k]: the last k + 1 values
    last = sums[np.clip(len(values) - 1 - starts, 0, None)] if len(values) else np.zeros((len(starts),) + values.shape[1:])
    return np.where((starts < len(values)).reshape((-1,) + (1,) * (values.ndim - 1)), last, 0.0)


def _kept(p: np.ndarray, t: np.ndarray) -> np.ndarray:
    """``exp(-p T)``, neurons by grid points: the chance a neuron is not used within ``T`` tokens (Poisson
    form). Exponents below -700 give 0 (and no subnormal numbers, which are slow)."""
    return np.exp(np.maximum(-np.multiply.outer(p, t), -700.0))


def _interpolated(held: np.ndarray, missed: np.ndarray, low: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Misses at ``capacity``, linear between grid points ``low`` and ``low + 1`` (``held`` and ``missed``
    indexed ``[grid point, ...]`` and gathered along the last axes by the caller)."""
    below, above = held[0], held[1]
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.clip(np.where(above > below, (capacity - below) / (above - below), 1.0), 0.0, 1.0)
    return np.maximum(missed[0] + share * (missed[1] - missed[0]), 0.0)


class CacheCurves:
    """Che's curves of the neurons from each of ``starts`` on: distinct neurons held and expected misses
    per token at each characteristic time of the grid; ``misses`` reads them for any number of slots."""

    def __init__(self, p: np.ndarray, starts: np.ndarray):
        p = np.clip(np.asarray(p, dtype=np.float64), 0.0, 1.0)
        self.starts = np.asarray(starts, dtype=np.int64)
        kept = _kept(p, _T_GRID)  # [neurons, grid]
        self.held = ((len(p) - self.starts)[:, None] - _from_end(kept, self.starts)).T  # [grid, starts], rising
        self.missed = _from_end(p[:, None] * kept, self.starts).T  # [grid, starts]
        self.firing = _from_end((p > 0).astype(np.float64), self.starts)  # neurons that ever fire
        self.n = len(p)

    def misses(self, slots: np.ndarray) -> np.ndarray:
        """``out[a, b]``: expected misses per token with ``slots[a]`` slots, neurons from ``starts[b]`` on."""
        capacity = np.minimum(np.asarray(slots, dtype=np.float64)[:, None], self.n - self.starts)
        step = np.clip((self.held[None] <= capacity[:, None, :]).sum(axis=1), 1, len(_T_GRID) - 1)
        column = np.arange(len(self.starts))
        pair = np.stack([step - 1, step])  # [2, slots, starts]
        misses = _interpolated(self.held[pair, column], self.missed[pair, column], step - 1, capacity)
        return np.where(capacity >= self.firing, 0.0, misses)


def _one_suffix(p: np.ndarray, slots: float) -> float:
    """``expected_misses`` for one set and one cache size, evaluating the grid only where binary search
    needs it (the same numbers as ``CacheCurves``, to rounding)."""
    capacity = min(float(slots), len(p))
    if capacity >= np.count_nonzero(p):
        return 0.0

    def point(index: int) -> tuple[float, float]:
        kept = _kept(p, _T_GRID[index])
        return len(p) - float(kept.sum()), float((p * kept).sum())

    low, high = 0, len(_T_GRID) - 1  # held(low) <= capacity, the last such grid point
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if point(middle)[0] <= capacity else (low, middle - 1)
    low = min(low, len(_T_GRID) - 2)
    (held_low, missed_low), (held_high, missed_high) = point(low), point(low + 1)
    held, missed = np.array([held_low, held_high]), np.array([missed_low, missed_high])
    return float(_interpolated(held, missed, np.array(low), np.array(capacity)))


def expected_misses(p: np.ndarray, starts: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """``out[a, b]``: expected misses per token of an LRU cache of ``slots[a]`` slots serving the neurons
    ``p[starts[b]:]`` (firing probabilities per token), by Che's approximation. As in the runtime, a cache
    never has more slots than neurons to serve; one that holds every neuron that fires never misses."""
    starts, slots = np.atleast_1d(starts), np.atleast_1d(slots)
    if len(starts) * len(slots) == 1:
        p = np.clip(np.asarray(p, dtype=np.float64), 0.0, 1.0)[int(starts[0]):]
        return np.array([[_one_suffix(p, slots[0])]])
    return CacheCurves(p, starts).misses(slots)
