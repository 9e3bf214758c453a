"""The bracketed search over hidden sizes and the best-trade-off fallback, on fake candidates."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from powerinfer_tools.predictors.search import best_trade_off, search_sizes
from powerinfer_tools.predictors.trainer import hidden_ladder

LADDER = hidden_ladder(1024)  # 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024


@dataclass
class Fake:
    hidden: int
    recall: float = 0.0
    precision: float = 0.0


def search(sizes, start, smallest_passing):
    """Run the search on a layer where exactly the sizes >= ``smallest_passing`` pass."""
    chosen, tried = search_sizes(sizes, start, Fake, lambda c: c.hidden >= smallest_passing)
    return (chosen.hidden if chosen else None), [c.hidden for c in tried]


@pytest.mark.parametrize("start, smallest_passing, order", [
    (8, 8, [8]),  # the first layer of an easy model: one candidate
    (8, 96, [8, 16, 32, 64, 128, 96]),  # doubling until 128 passes, then bisection between 64 and 128
    (8, 128, [8, 16, 32, 64, 128, 96]),
    (96, 96, [96, 64]),  # a later layer starting at the previous layer's size: its neighbour below fails
    (96, 48, [96, 64, 32, 48]),  # one step down, then halving, then bisection
    (256, 96, [256, 192, 96, 48, 64]),
    (100, 256, [96, 192, 384, 256]),  # a start between ladder sizes begins at the size below it
])
def test_search_order(start, smallest_passing, order):
    assert search(LADDER, start, smallest_passing) == (smallest_passing, order)


def test_nothing_passes_within_the_budget():
    sizes = LADDER[:12]  # up to 384: the budget's share
    assert search(sizes, 8, 512) == (None, [8, 16, 32, 64, 128, 256, 384])  # the largest allowed is tried
    assert search(sizes, 1000, 512) == (None, [384])  # a start above the budget is clamped to it


def test_the_smallest_passing_size_in_logarithmic_candidates():
    bound = 2 * math.ceil(math.log2(len(LADDER))) + 2
    for start in LADDER:
        for smallest_passing in LADDER:
            chosen, tried = search(LADDER, start, smallest_passing)
            assert chosen == smallest_passing
            assert len(tried) == len(set(tried)) <= bound
            below = LADDER.index(chosen) - 1
            assert below < 0 or LADDER[below] in tried  # its neighbour below was seen to fail


def test_best_trade_off():
    at_target = [Fake(8, 0.96, 0.30), Fake(16, 0.95, 0.45), Fake(32, 0.97, 0.40)]
    assert best_trade_off(at_target, 0.95).hidden == 16  # reaching recall: the most precise
    short = [Fake(8, 0.90, 0.30), Fake(16, 0.92, 0.20), Fake(32, 0.92, 0.25)]
    assert best_trade_off(short, 0.95).hidden == 32  # none reaches it: highest recall, then precision
