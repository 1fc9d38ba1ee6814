"""The window rule: which logical blocks of a sequence stay in high precision.

The first ``sink_blocks`` blocks (attention sinks) and the blocks that still
overlap the last ``residual_tokens`` tokens are kept in the model dtype; the
others are sealed into the resident (quantized) format.  :func:`block_state` is
the one definition; the block manager follows it (with lazy sealing, see
:mod:`kvq.cache.block_manager`), and the plan and the scheduler count with it.
Host only: Python and numpy, no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import numpy as np

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


def _hp_below(m: int, n: int, policy: WindowPolicy) -> int:
    """How many of the logical blocks ``[0, m)`` are hp at length ``n`` (:func:`block_state`)."""
    sinks = min(m, policy.sink_blocks)
    if policy.write_direct and policy.residual_tokens == 0:
        return sinks
    sealed_to = max(policy.sink_blocks, max(n - policy.residual_tokens, 0) // policy.block_size)
    return sinks + max(0, m - sealed_to)


def append_counts(n_old: int, n_new: int, policy: WindowPolicy) -> tuple[int, int]:
    """(q, hp) blocks a sequence holds right after growing from ``n_old`` to ``n_new`` tokens in one
    call (lazy sealing: the blocks it had follow :func:`block_state` at ``n_old``, the new ones at
    ``n_new``).  ``n_old = 0`` is a prompt's first allocation; a prefix hit of ``h`` tokens
    allocated with the first chunk is ``n_old = h``."""
    bs = policy.block_size
    nb_old, nb_new = -(-n_old // bs), -(-n_new // bs)
    hp = _hp_below(nb_old, n_old, policy) + rule_counts(n_new, policy)[1] - _hp_below(nb_old, n_new, policy)
    return nb_new - hp, hp


@lru_cache(maxsize=4096)
def _hp_peak(last: int, max_chunk: int, policy: WindowPolicy) -> int:
    bs, sinks, res = policy.block_size, policy.sink_blocks, policy.residual_tokens
    direct_only = policy.write_direct and res == 0

    def hp_below(m, n):  # _hp_below over arrays of lengths n
        head = np.minimum(m, sinks)
        if direct_only:
            return head
        return head + np.maximum(0, m - np.maximum(sinks, np.maximum(n - res, 0) // bs))

    # Past the sinks and one window (plus margins), the count repeats with period bs in n_old, and in
    # the step once the new blocks reach past the window: these ranges see every value.
    n_old_stop = min(last, sinks * bs + res + 2 * bs)
    k_cap = sinks * bs + res + 3 * bs
    peak = 0
    for n_old in range(n_old_stop):
        k_max = min(max_chunk, last - n_old)
        n_new = n_old + np.append(np.arange(1, min(k_max, k_cap) + 1), k_max)
        nb_old, nb_new = -(-n_old // bs), -(-n_new // bs)
        hp = int(hp_below(nb_old, n_old)) + hp_below(nb_new, n_new) - hp_below(nb_old, n_new)
        peak = max(peak, int(hp.max()))
    return peak


@lru_cache(maxsize=4096)
def _q_peak(last: int, max_chunk: int, policy: WindowPolicy) -> int:
    # The most q blocks come with the call that reaches ``last``; which old length it starts from
    # matters only near ``last`` and, further back, repeats with period bs.
    bs = policy.block_size
    lo = max(0, last - max_chunk)
    span = policy.sink_blocks * bs + policy.residual_tokens + 3 * bs
    olds = {*range(lo, min(last, lo + span)), *range(max(lo, last - span), last)}
    return max(append_counts(n_old, last, policy)[0] for n_old in olds)


def peak_blocks(last: int, policy: WindowPolicy, max_chunk: int | None = None) -> tuple[int, int]:
    """Most (q, hp) blocks one sequence holds on its way to ``last`` cached tokens, when every call
    adds at most ``max_chunk`` tokens (prompt chunks, prefix hits, decode steps; default
    ``last``: the whole prompt at once) starting from any length (re-prefill after preemption).

    A chunk briefly holds two recent windows in hp: the one its first query reads exact (the
    blocks before it, settled at the old length) and the one that ends it (its new blocks).
    """
    assert last >= 1
    max_chunk = last if max_chunk is None else max(1, min(max_chunk, last))
    bs = policy.block_size
    horizon = policy.sink_blocks * bs + policy.residual_tokens + 6 * bs  # the hp peak stops growing past it
    k_cap = policy.sink_blocks * bs + policy.residual_tokens + 3 * bs
    return (_q_peak(last, max_chunk, policy),
            _hp_peak(min(last, horizon + k_cap), min(max_chunk, k_cap + bs), policy))


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
