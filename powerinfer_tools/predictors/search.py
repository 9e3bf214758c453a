"""Which hidden sizes to train for one layer: a bracketed search over the ladder.

The ladder (8, 12, 16, 24, 32, 48, ...) grows by about sqrt 2 per step, so two steps
double the size. Passing (the recall target at ``min_precision``) is taken to be
monotone in the size, and the search looks for the smallest passing size among the
``sizes`` the layer's share of the budget allows, in O(log) candidates:

1. Start at ``start`` (the trainer passes the size the previous layer chose, or the
   largest it tried when none passed there, or the smallest size for the first layer:
   neighbouring layers tend to need similar sizes).
2. If the start fails, double (two ladder steps) until a size passes or the largest
   allowed size has failed. If it passes, try the size one ladder step below, then
   keep halving while sizes pass: a neighbour that fails settles it at once, and
   smaller candidates cost less to train.
3. Bisect the ladder indices between the last failing and the first passing size
   until they are neighbours; the passing one is chosen.

When no allowed size passes, ``best_trade_off`` picks among those tried: the most
precise of the sizes that reach the recall target, or, when none reaches it, the
highest recall (ties: the higher precision). Those candidates were stopped early
(after the epochs that showed they cannot pass); training the fallback to the end
instead cost more than all the other candidates of a layer together on a hard model
(the largest size, all extra epochs) and bought recall with precision (TinyLlama
shape, rank-256 synthetic model, 10k pairs, hidden 384: held-out recall 83% → 89% and
precision 60% → 46% from 3 epochs to 12).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class Candidate(Protocol):
    hidden: int
    recall: float
    precision: float


def search_sizes(sizes: list[int], start: int, fit: Callable[[int], Candidate],
                 passes: Callable[[Candidate], bool]) -> tuple[Candidate | None, list[Candidate]]:
    """The smallest passing size's candidate (None when none passes) and every candidate tried, in order.

    ``start`` is clamped into ``sizes`` (it need not be one of them); ``fit(hidden)`` trains one.
    """
    tried: dict[int, Candidate] = {}

    def trial(index: int) -> bool:
        if sizes[index] not in tried:
            tried[sizes[index]] = fit(sizes[index])
        return passes(tried[sizes[index]])

    index = max((i for i, s in enumerate(sizes) if s <= start), default=0)
    if trial(index):
        failing, passing = _bracket_down(index, trial)
    else:
        failing, passing = _bracket_up(index, len(sizes) - 1, trial)
    if passing is None:
        return None, list(tried.values())
    while failing is not None and passing - failing > 1:
        middle = (failing + passing) // 2
        if trial(middle):
            passing = middle
        else:
            failing = middle
    return tried[sizes[passing]], list(tried.values())


def _bracket_down(passing: int, trial: Callable[[int], bool]) -> tuple[int | None, int]:
    """From a passing index: one step down, then halving, until an index fails or index 0 passes."""
    step = 1
    while passing > 0:
        below = max(passing - step, 0)
        if not trial(below):
            return below, passing
        passing, step = below, 2
    return None, passing


def _bracket_up(failing: int, last: int, trial: Callable[[int], bool]) -> tuple[int, int | None]:
    """From a failing index: doubling (two steps) until an index passes or ``last`` has failed."""
    while failing < last:
        above = min(failing + 2, last)
        if trial(above):
            return failing, above
        failing = above
    return failing, None


def best_trade_off(tried: list[Candidate], recall_target: float) -> Candidate:
    """The fallback when no size passes (rule in the module docstring)."""
    return max(tried, key=lambda c: (c.recall >= recall_target,
                                        c.precision if c.recall >= recall_target else c.recall,
                                        c.precision))
