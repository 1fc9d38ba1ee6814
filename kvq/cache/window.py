"""The window rule: which logical blocks of a sequence stay in high precision.

The first ``sink_blocks`` blocks (attention sinks) and the blocks that still
overlap the last ``residual_tokens`` tokens are kept in the model dtype; the
others are sealed into the resident (quantized) format.  :func:`block_state` is
the one definition; the block manager follows it (with lazy sealing, see
:mod:`kvq.cache.block_manager`), and the plan and the scheduler count with it.
Pure Python, no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Pool = Literal["q", "hp"]
POOLS: tuple[Pool, Pool] = ("q", "hp")


@dataclass(frozen=True)
class WindowPolicy:
    """Which logical blocks stay in high precision (see :func:`block_state`)."""

    block_size: int
    sink_blocks: int = 0
    residual_tokens: int = 0
    write_direct: bool = True  # the q format can take single tokens (per-token scales)

    def __post_init__(self) -> None:
        for name, lo in (("block_size", 1), ("sink_blocks", 0), ("residual_tokens", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"WindowPolicy.{name} must be an int >= {lo}, got {v!r}")


def block_state(i: int, n: int, policy: WindowPolicy) -> Pool:
    """Pool of logical block ``i`` in a sequence of ``n`` cached tokens.

    Sealed ("q") iff ``i >= sink_blocks`` and either the block ends at least
    ``residual_tokens`` before ``n`` or the format writes directly with no
    residual window. Monotone: as ``n`` grows a block only goes hp -> q.
    """
    if i < policy.sink_blocks:
        return "hp"
    if policy.write_direct and policy.residual_tokens == 0:
        return "q"
    return "q" if (i + 1) * policy.block_size <= n - policy.residual_tokens else "hp"


def rule_counts(n: int, policy: WindowPolicy) -> tuple[int, int]:
    """(q, hp) blocks a sequence of ``n`` cached tokens holds under :func:`block_state` (closed form)."""
    bs = policy.block_size
    nb = -(-n // bs)
    sinks = min(policy.sink_blocks, nb)
    if policy.write_direct and policy.residual_tokens == 0:
        return nb - sinks, sinks
    q = max(0, max(n - policy.residual_tokens, 0) // bs - policy.sink_blocks)  # blocks [sink, w) are sealed
    return q, nb - q


def peak_blocks(first: int, last: int, policy: WindowPolicy) -> tuple[int, int]:
    """Most (q, hp) blocks one sequence holds while its cached length grows from ``first`` to ``last``.

    Covers prompt allocations at any length in ``[first, last]`` (re-prefill after
    preemption) and one-token appends from every length in ``[first, last)``: an
    append settles the old blocks at the old length and may open a block, so it
    can hold one hp block more than the rule gives (lazy sealing).
    """
    assert 1 <= first <= last
    bs = policy.block_size
    q_peak = rule_counts(last, policy)[0]  # q blocks only grow with the length
    # Past sink_blocks * bs + residual_tokens the hp count repeats with period bs: one period suffices.
    stop = min(last, max(first, policy.sink_blocks * bs + policy.residual_tokens) + bs)
    hp_peak = 0
    for n in range(first, stop + 1):
        hp = rule_counts(n, policy)[1]
        if n < last and n % bs == 0:  # appending at n opens block n // bs
            hp += block_state(n // bs, n + 1, policy) == "hp"
        hp_peak = max(hp_peak, hp)
    return q_peak, hp_peak


def can_seal(policy: WindowPolicy) -> bool:
    """Whether a block can ever go hp -> q after it is written (a seal op): block-sealed
    formats and recent windows; never for direct writes without a window."""
    return not (policy.write_direct and policy.residual_tokens == 0)


def exact_from(p: int, policy: WindowPolicy) -> int:
    """First position of the recent window a query at position ``p`` reads exact: keys
    ``[exact_from(p), p]`` and the sink blocks are read in the model dtype, every other key as
    its block is (or will be) sealed.  This is :func:`block_state` at length ``p`` (the state
    a decode of ``p`` sees after lazy sealing), so prompts, chunked or not, and decode steps
    read the same; ``p + 1`` for formats written directly with no window (nothing recent is
    exact)."""
    if not can_seal(policy):
        return p + 1
    return max(0, (p - policy.residual_tokens) // policy.block_size * policy.block_size)


def reads_exact(j: int, p: int, policy: WindowPolicy) -> bool:
    """Whether a query at position ``p`` reads key ``j <= p`` exact (:func:`exact_from`)."""
    return j // policy.block_size < policy.sink_blocks or j >= exact_from(p, policy)
