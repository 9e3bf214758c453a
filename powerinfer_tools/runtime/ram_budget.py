"""What a RAM budget (``pitools run --ram``) keeps in memory: the plan the loader builds the neuron caches by.

The budget is for the model's weights. Everything but the FFN rows (attention, norms, the output head,
predictors, biases) is read every token and is loaded whole, but for the token embedding, whose rows are
read from the file as tokens come unless the head multiplies it too (tied). What is left holds FFN rows,
shared equally by the layers: per layer the hottest CPU neurons are pinned and ``cache_share`` of the rows
are cache slots for the rest (``neuron_cache``). A split file solved with ``pitools solve --ram`` says
which neurons to pin and how large the cache is; without one, the file's profiled frequencies say which
neurons are hottest (in file order when it has none). A mixture's layer shares its rows among its experts
by how often each neuron is read per token: its firing frequency over the tokens routed to its expert
times the expert's routing frequency; so are its cache slots, by routing frequency.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.runtime.neuron_cache import NeuronCache, NeuronFile
from powerinfer_tools.solver.tiers import MIN_CACHE_SLOTS as MIN_SLOTS  # the solver plans with the same minimum
from powerinfer_tools.units import format_size

# Of each layer's rows in memory, the share that are cache slots for cold neurons; the rest pin the hottest.
# With the hottest pinned, a larger cache raised the hit rate but read more from disk (examples/cache_policies.py).
DEFAULT_CACHE_SHARE = 0.1


@dataclass(frozen=True)
class RamPlan:
    budget: int  # bytes the weights may occupy
    dense_bytes: int  # loaded whole: every tensor but the FFN rows
    neuron_bytes: int  # one neuron's rows (gate, up, ffn_down_t) in memory
    pinned: tuple[np.ndarray, ...]  # per layer: neuron ids held for the whole run
    capacity: tuple[int, ...]  # per layer: cache slots

    @property
    def planned_bytes(self) -> int:
        rows = sum(len(p) for p in self.pinned) + sum(self.capacity)
        return self.dense_bytes + rows * self.neuron_bytes


def _minimum(dense_bytes: int, neuron_bytes: int, n_layers: int) -> int:
    return dense_bytes + n_layers * MIN_SLOTS * neuron_bytes


def plan_ram(budget: int, dense_bytes: int, neuron_bytes: int, cpu_neurons: list[np.ndarray],
             frequencies: list[np.ndarray | None], cache_share: float = DEFAULT_CACHE_SHARE,
             experts: int = 1, routing: list[np.ndarray | None] | None = None) -> RamPlan:
    """Pin the hottest of each FFN's ``cpu_neurons`` (those not on a GPU) and size its cache within
    ``budget``. The FFNs are the layers', or, with ``experts`` per layer, each layer's experts in turn;
    ``routing`` (per layer, None where unknown) is how often each expert is routed to."""
    if not 0 < cache_share < 1:
        raise PitoolsError(f"cache share must be between 0 and 1, got {cache_share}")
    n_units = len(cpu_neurons)
    minimum = _minimum(dense_bytes, neuron_bytes, n_units)
    if budget < minimum:
        raise PitoolsError(f"--ram {format_size(budget)} is too small for this model: its attention, head and "
                           f"predictors take {format_size(dense_bytes)}, and a neuron cache of {MIN_SLOTS} neurons "
                           f"per layer {format_size(minimum - dense_bytes)} more: give at least "
                           f"{format_size(minimum, round_up=True)}")
    rows = (budget - dense_bytes) // (n_units * neuron_bytes)  # per FFN; a layer's experts share theirs
    pinned, capacity = [], []
    for first in range(0, n_units, experts):
        layer = slice(first, first + experts)
        shares = None if routing is None else routing[first // experts]
        plan = _layer_plan(rows * experts, cpu_neurons[layer], frequencies[layer], shares, cache_share)
        pinned += plan[0]
        capacity += plan[1]
    return RamPlan(budget, dense_bytes, neuron_bytes, tuple(pinned), tuple(capacity))


def _layer_plan(rows: int, cpu_neurons: list[np.ndarray], frequencies: list[np.ndarray | None],
                shares: np.ndarray | None, cache_share: float) -> tuple[list[np.ndarray], list[int]]:
    """One layer's pinned neurons and cache slots per FFN (its own, or each expert's), ``rows`` in all:
    slots first (``cache_share`` of the rows, each FFN at least ``MIN_SLOTS``; a mixture's by routing
    frequency), then the hottest neurons by reads per token. Without frequencies or routing, the FFNs
    share equally, each pinning its hottest (or its first)."""
    if shares is None or shares.sum() <= 0 or any(f is None for f in frequencies):
        share = rows // len(cpu_neurons)
        pinned, slots = [], []
        for n, f in zip(cpu_neurons, frequencies):
            k = 0 if share >= len(n) else max(MIN_SLOTS, int(cache_share * share))  # it all fits: no cache
            hottest = n if f is None else n[np.argsort(-f[n], kind="stable")]
            pinned.append(np.sort(hottest[: share - k]))
            slots.append(k)
        return pinned, slots
    if rows >= sum(len(n) for n in cpu_neurons):  # the whole layer fits: no cache
        return [np.sort(n) for n in cpu_neurons], [0] * len(cpu_neurons)
    slots = [max(MIN_SLOTS, int(cache_share * rows * share / shares.sum())) for share in shares]
    reads = np.concatenate([share * f[n] for share, f, n in zip(shares, frequencies, cpu_neurons)])
    unit = np.repeat(np.arange(len(cpu_neurons)), [len(n) for n in cpu_neurons])
    chosen = np.argsort(-reads, kind="stable")[: max(0, rows - sum(slots))]
    neurons = np.concatenate(cpu_neurons)
    pinned = [np.sort(neurons[chosen[unit[chosen] == u]]) for u in range(len(cpu_neurons))]
    # an expert whose every neuron is pinned needs no cache
    return pinned, [0 if len(p) == len(n) else k for p, n, k in zip(pinned, cpu_neurons, slots)]


def plan_from_split(budget: int, dense_bytes: int, neuron_bytes: int, ram_masks, cache_bytes: int,
                    cpu_neurons: list[np.ndarray], source: str) -> RamPlan:
    """The plan a split file solved with ``--ram`` records: its pinned neurons and cache size, checked
    against ``budget``."""
    n_layers = len(cpu_neurons)
    slots = max(MIN_SLOTS, cache_bytes // (n_layers * neuron_bytes))
    pinned = tuple(np.flatnonzero(mask) for mask in ram_masks)
    capacity = tuple(0 if len(p) >= len(c) else min(slots, len(c) - len(p)) for p, c in zip(pinned, cpu_neurons))
    plan = RamPlan(budget, dense_bytes, neuron_bytes, pinned, capacity)
    if plan.planned_bytes > budget:
        raise PitoolsError(f"{source}: its RAM tier needs {format_size(plan.planned_bytes)} of weights in memory, "
                           f"more than --ram {format_size(budget)}; solve again with this budget")
    return plan


@dataclass
class RamState:
    """A loaded model's weights under a RAM budget: the plan, what is in memory (measured), and its caches."""

    plan: RamPlan
    dense_resident: int  # bytes of the tensors read whole
    caches: list[NeuronCache]
    file: NeuronFile

    @property
    def resident_bytes(self) -> int:
        """The weights in memory now: the tensors read whole, every pinned row and cache slot."""
        return self.dense_resident + sum(c.nbytes for c in self.caches)
