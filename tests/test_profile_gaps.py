"""scripts/profile_engine.py's kernel_gaps: busy time counts overlapping kernels once, and every
idle stretch between kernels is a gap named by its neighbours (what says whether a step loses
its time to launch latency or to a device waiting for the host)."""

from __future__ import annotations

from scripts.profile_engine import kernel_gaps


def test_gaps_between_kernels_and_overlaps_counted_once():
    spans = [(10, 20, "b"), (0, 5, "a"), (12, 25, "c"), (25, 30, "d"), (40, 41, "e"), (40.5, 42, "f")]
    busy, span, gaps = kernel_gaps(spans)
    assert span == 42
    assert busy == 5 + 20 + 2  # [0, 5], [10, 30] (b, c, d touch or overlap), [40, 42]
    assert gaps == [(5, "a", "b"), (10, "d", "e")]


def test_a_kernel_inside_another_keeps_the_outer_end():
    busy, span, gaps = kernel_gaps([(0, 100, "long"), (10, 20, "short"), (150, 160, "next")])
    assert (busy, span) == (110, 160)
    assert gaps == [(50, "long", "next")]
    assert kernel_gaps([]) == (0.0, 0.0, [])
