"""95% intervals for the evaluation's quality figures.

Scored positions are not independent: neighbouring tokens share their
context, so a t-interval over single positions would be too narrow.  The
figures use *batch means* instead, the standard interval for a correlated
series: each passage's scored positions are cut into consecutive segments of
``SEGMENT`` positions, the statistic is averaged per segment, and the interval
is a Student t interval over the segment means (degrees of freedom = segments
- 1).  Segments come from several passages of the text (``--passages``), which
are disjoint stretches of it where the text allows.

What is averaged per position, format against baseline on the same tokens:

* ``dnll``: NLL(format) - NLL(baseline).  Its mean is log(ppl_f / ppl_b), so
  the relative perplexity change and its interval are ``exp(.) - 1`` of the
  mean and of the interval's ends;
* ``kl``: KL(baseline || format) of the next-token distributions, nats;
* ``top1``: 1 where both argmaxes agree.

Passkey accuracy (a share of needles) gets a Wilson score interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

#: Positions per segment of the batch-means interval.
SEGMENT = 32

# Student t, two-sided 95% (0.975 quantile), for 1..30 degrees of freedom.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """0.975 quantile of Student's t with ``df`` degrees of freedom (tabulated to 30; beyond,
    1.96 + 2.5 / df, within 0.002 of the exact value)."""
    if df < 1:
        raise ValueError(f"a t interval needs at least 1 degree of freedom, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.5 / df


def segment_means(values: Sequence[float], segment: int = SEGMENT) -> list[float]:
    """Means of consecutive whole segments of one passage's per-position values (a short tail
    that would make an unequal segment is folded into the last one)."""
    n = len(values)
    if n == 0:
        return []
    k = max(1, n // segment)
    bounds = [i * segment for i in range(k)] + [n]
    return [sum(values[a:b]) / (b - a) for a, b in zip(bounds, bounds[1:])]


def mean_ci(units: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): Student t 95% interval over the unit means; a single unit gives
    a zero-width interval (no spread to estimate)."""
    n = len(units)
    if n == 0:
        raise ValueError("no units to average")
    m = sum(units) / n
    if n == 1:
        return m, m, m
    var = sum((u - m) ** 2 for u in units) / (n - 1)
    half = t975(n - 1) * math.sqrt(var / n)
    return m, m - half, m + half


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score 95% interval of a share ``successes / n``."""
    if n <= 0:
        raise ValueError("a share of zero trials has no interval")
    p = successes / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, centre - half), min(1.0, centre + half)
