"""The exact solver of ``kvq tune``: one format per tensor, least summed loss under a byte budget.

A multiple-choice knapsack: tensor ``i`` (layer x {K, V}) takes exactly one of its
options, each with a cost (bytes of one cache block, sidecars included: whole
numbers) and a loss (its measured sensitivity: the token KL against the baseline
with only that tensor quantized); the plan minimizes the summed loss with the
summed cost at most the budget.  Dynamic programming over the budget in units of
the greatest common divisor of every cost is exact (no rounding of costs): the
table is ``items x (budget / gcd + 1)`` and each item is one vectorized min over
its options.  No tensors (numpy only), so the solver is tested against brute
force on random instances.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Option:
    """One way to store one tensor: its name, bytes per block and loss."""

    name: str
    cost: int
    loss: float

    def __post_init__(self) -> None:
        if not isinstance(self.cost, int) or isinstance(self.cost, bool) or self.cost < 0:
            raise ValueError(f"option {self.name!r}: cost must be an int >= 0, got {self.cost!r}")
        if not math.isfinite(self.loss):
            raise ValueError(f"option {self.name!r}: loss must be finite, got {self.loss!r}")


@dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]  # per item, the index of its option
    cost: int
    loss: float


def solve(items: Sequence[Sequence[Option]], budget: int) -> Solution:
    """The choice of one option per item with the least summed loss and summed cost <= ``budget``.

    Ties in loss go to the cheaper plan.  ValueError when even the cheapest choice costs more
    than the budget (naming that minimum) or an item has no options."""
    if not items:
        raise ValueError("nothing to choose: no items")
    for i, opts in enumerate(items):
        if not opts:
            raise ValueError(f"item {i} has no options")
    if not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget must be an int >= 0, got {budget!r}")
    floor = sum(min(o.cost for o in opts) for opts in items)
    if floor > budget:
        raise ValueError(f"the budget ({budget} bytes per block) is below the cheapest plan ({floor})")
    g = math.gcd(*(o.cost for opts in items for o in opts)) or 1
    cap = budget // g
    # best[c]: least loss of the items so far with cost exactly c (units of g); inf where impossible
    best = np.full(cap + 1, np.inf)
    best[0] = 0.0
    picks = []
    for opts in items:
        new = np.full(cap + 1, np.inf)
        pick = np.full(cap + 1, -1, dtype=np.int32)
        for j, o in enumerate(opts):
            c = o.cost // g
            if c > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[c:] = best[:cap + 1 - c] + o.loss
            better = cand < new
            new[better] = cand[better]
            pick[better] = j
        best = new
        picks.append(pick)
    end = int(np.argmin(best))  # argmin takes the first, i.e. cheapest, of equal losses
    choice = []
    c = end
    for opts, pick in zip(reversed(items), reversed(picks)):
        j = int(pick[c])
        choice.append(j)
        c -= opts[j].cost // g
    assert c == 0, c
    choice.reverse()
    cost = sum(items[i][j].cost for i, j in enumerate(choice))
    return Solution(tuple(choice), cost, float(sum(items[i][j].loss for i, j in enumerate(choice))))


def frontier(items: Sequence[Sequence[Option]], budgets: Sequence[int]) -> list[Solution]:
    """:func:`solve` at each budget (budgets below the cheapest plan are skipped)."""
    floor = sum(min(o.cost for o in opts) for opts in items)
    return [solve(items, b) for b in budgets if b >= floor]
