"""The RAM plan (runtime/ram_budget.py): which neurons a budget pins and how many cache slots each FFN gets."""

from __future__ import annotations

import numpy as np
import pytest

from powerinfer_tools.runtime.ram_budget import MIN_SLOTS, plan_ram

D_FF, NEURON_BYTES, DENSE_BYTES = 400, 10, 1000


def _frequencies(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random(D_FF)


def test_each_layer_pins_its_hottest_neurons_and_keeps_a_share_of_slots():
    freqs = [_frequencies(0), _frequencies(1)]
    budget = DENSE_BYTES + 2 * 200 * NEURON_BYTES  # 200 rows a layer
    plan = plan_ram(budget, DENSE_BYTES, NEURON_BYTES, [np.arange(D_FF)] * 2, freqs, cache_share=0.1)
    assert plan.capacity == (20, 20)
    for pinned, f in zip(plan.pinned, freqs):
        assert np.array_equal(pinned, np.sort(np.argsort(-f)[:180]))
    assert plan.planned_bytes <= budget


def test_a_layer_that_fits_needs_no_cache():
    plan = plan_ram(DENSE_BYTES + 2 * D_FF * NEURON_BYTES, DENSE_BYTES, NEURON_BYTES, [np.arange(D_FF)] * 2,
                    [None, None])
    assert plan.capacity == (0, 0) and all(len(p) == D_FF for p in plan.pinned)


def test_a_mixtures_experts_share_their_layers_rows_by_reads_per_token():
    """Expert 0 is routed to 60% of tokens, expert 2 never: the layer's rows go to the neurons read most
    per token (routing frequency times firing frequency over the routed tokens), slots by routing."""
    routing = np.array([0.6, 0.4, 0.0])
    freqs = [_frequencies(e) for e in range(3)]
    budget = DENSE_BYTES + 3 * 100 * NEURON_BYTES  # 300 rows for the layer's three experts
    plan = plan_ram(budget, DENSE_BYTES, NEURON_BYTES, [np.arange(D_FF)] * 3, freqs, cache_share=0.2,
                    experts=3, routing=[routing])
    assert plan.capacity == (36, 24, MIN_SLOTS) and plan.planned_bytes <= budget
    reads = np.concatenate([share * f for share, f in zip(routing, freqs)])
    kept = 300 - sum(plan.capacity)
    chosen = np.sort(np.argsort(-reads, kind="stable")[:kept])
    assert np.array_equal(np.concatenate([p + e * D_FF for e, p in enumerate(plan.pinned)]), chosen)
    assert len(plan.pinned[0]) > len(plan.pinned[1]) > len(plan.pinned[2]) == 0


@pytest.mark.parametrize("routing", [None, [None]], ids=["no routing given", "none recorded"])
def test_without_routing_frequencies_experts_share_equally(routing):
    freqs = [_frequencies(e) for e in range(2)]
    plan = plan_ram(DENSE_BYTES + 2 * 100 * NEURON_BYTES, DENSE_BYTES, NEURON_BYTES, [np.arange(D_FF)] * 2, freqs,
                    cache_share=0.1, experts=2, routing=routing)
    assert plan.capacity == (MIN_SLOTS, MIN_SLOTS) and [len(p) for p in plan.pinned] == [100 - MIN_SLOTS] * 2
