"""The block manager's data (kvq.cache.block_manager): block references, the ops a caller must run
(seal, copy, swap, host-tier copies, remote fills) and one sequence's blocks."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from kvq.cache.host_tier import LoadRequest, StoreRequest
from kvq.cache.tiers import pool_tier
from kvq.cache.window import Pool

PENDING_TOKEN = -1

SeqId = Hashable  # int or str in practice


@dataclass(frozen=True)
class BlockRef:
    pool: Pool
    block_id: int


@dataclass(frozen=True)
class SealOp:
    """Quantize hp block ``src_hp_block`` into q block ``dst_q_block`` (already in the table)."""

    seq_id: SeqId
    logical_index: int
    src_hp_block: int
    dst_q_block: int


@dataclass(frozen=True)
class DemoteOp:
    """Re-store ``src`` (a q block of one tier) into ``dst`` (a block of a lower tier, already in the
    table): dequantized and quantized again (elastic precision, kvq.cache.tiers)."""

    seq_id: SeqId
    logical_index: int
    src: BlockRef
    dst: BlockRef


@dataclass(frozen=True)
class WipeOp:
    """Zero ``slabs`` of a tiered arena in every layer: each was handed to a tier other than the one
    whose bytes it holds (kvq.cache.arena, "Bytes a tier did not write").  Run before anything of the
    step reads or writes the cache, connectors' copies included (:meth:`Arena.take_wipes`)."""

    slabs: tuple[int, ...]


@dataclass(frozen=True)
class CopyOp:
    """Copy ``src`` to ``dst`` (same pool) before writing into ``dst`` (copy-on-write)."""

    src: BlockRef
    dst: BlockRef


@dataclass(frozen=True)
class PrefixHit:
    """Tokens of a prompt whose KV came from the prefix cache (whole blocks, < len(prompt)).

    ``num_loading_tokens`` of them (the last ones) come from the CPU prefix tier: they are there
    only once the sequence's :class:`HostLoadOp` has completed (:meth:`BlockManager.load_state`)."""

    num_cached_tokens: int
    num_loading_tokens: int = 0


@dataclass(frozen=True)
class SwapOp:
    """Move one sequence's blocks between the device pools and the host tier: ``direction`` "out"
    copies device -> host, "in" host -> device; ``q`` and ``hp`` are ``(src, dst)`` block ids of
    each pool (device ids on the device side, host ids on the host side).  ``tiers``: elastic
    precision's lower tiers, ``(pool, pairs)`` for ``q1``, ``q2``... (a lower tier's block keeps its
    format on the host, in a resident block's bytes: host ids are the host q pool's)."""

    seq_id: SeqId
    direction: str
    q: tuple[tuple[int, int], ...]
    hp: tuple[tuple[int, int], ...]
    tiers: tuple[tuple[str, tuple[tuple[int, int], ...]], ...] = ()

    def pools(self) -> tuple[tuple[str, tuple[tuple[int, int], ...]], ...]:
        """``(device pool, pairs)`` of every pool the op moves blocks of."""
        return (("q", self.q), ("hp", self.hp), *self.tiers)

    @property
    def num_blocks(self) -> int:
        return sum(len(pairs) for _, pairs in self.pools())


@dataclass(frozen=True)
class HostStoreOp:
    """Copy full, computed device blocks into the CPU prefix tier (asynchronous: issue it, then
    report its end with :meth:`BlockManager.host_copy_done`).  The manager holds a reference on
    each device block until then, so nothing rewrites one while it is read."""

    requests: tuple[StoreRequest, ...]

    def pairs(self, pool: str) -> tuple[tuple[int, int], ...]:
        """``(device, host)`` block ids of device pool ``pool`` (q, hp, q1...), the argument order of
        ``HostKVPool.store``."""
        return tuple((r.device_block, r.host_block) for r in self.requests if r.pool == pool)

    def tier_pairs(self) -> tuple[tuple[str, tuple[tuple[int, int], ...]], ...]:
        """``((pool, pairs), ...)`` of the lower tiers' blocks (``HostKVPool.store``'s ``tier_pairs``)."""
        pools = sorted({r.pool for r in self.requests} - {"q", "hp"}, key=pool_tier)
        return tuple((p, self.pairs(p)) for p in pools)

    @property
    def num_blocks(self) -> int:
        return len(self.requests)


@dataclass(frozen=True)
class HostLoadOp:
    """Copy a prompt's prefix blocks from the CPU prefix tier into the device blocks its table
    already holds (asynchronous, like :class:`HostStoreOp`).  The sequence must not run until
    :meth:`BlockManager.load_state` says "done"."""

    seq_id: SeqId
    request: LoadRequest

    def pairs(self, pool: str) -> tuple[tuple[int, int], ...]:
        """``(host, device)`` block ids of device pool ``pool``, the argument order of ``HostKVPool.load``."""
        if pool in ("q", "hp"):
            return self.request.q_pairs if pool == "q" else self.request.hp_pairs
        return dict(self.request.tier_pairs).get(pool, ())

    def tier_pairs(self) -> tuple[tuple[str, tuple[tuple[int, int], ...]], ...]:
        """``((pool, pairs), ...)`` of the lower tiers' blocks (``HostKVPool.load``'s ``tier_pairs``)."""
        return self.request.tier_pairs

    @property
    def num_blocks(self) -> int:
        return len(self.request.device_blocks)


@dataclass(frozen=True)
class RemoteLoadOp:
    """A whole prompt's KV, to be filled from another server (a prefill peer, :mod:`kvq.transfer`)
    into the blocks ``table`` holds: laid out as a prompt of ``num_tokens`` tokens without a prefix
    hit (block ``i`` in pool ``block_state(i, num_tokens)``), nothing computed.  Outstanding until
    :meth:`BlockManager.remote_done`; a sequence freed before then leaves ``table``'s blocks out of
    use until it is called (the transfer may still be writing them)."""

    seq_id: SeqId
    ticket: int
    table: tuple[BlockRef, ...]
    num_tokens: int

    def blocks(self, pool: Pool) -> list[tuple[int, int]]:
        """``(logical index, block id)`` of the table's blocks in ``pool``, in logical order."""
        return [(i, r.block_id) for i, r in enumerate(self.table) if r.pool == pool]


Op = SealOp | CopyOp | SwapOp | DemoteOp
HostOp = HostStoreOp | HostLoadOp


class SeqBlocks:
    """Mutable per-sequence state; private to the manager."""

    __slots__ = ("changed", "hashes", "num_computed", "num_registered", "num_settled", "seal_from", "table",
                 "tier_from", "tokens")

    def __init__(self, tokens: list[int], table: list[BlockRef], num_computed: int, hashes: list[int], sink: int):
        self.tokens = tokens  # ids of all tokens with reserved slots
        self.table = table  # one BlockRef per logical block
        self.num_computed = num_computed  # tokens whose KV is written (prefix-cacheable)
        self.num_settled = 0  # length before the last append call (see module docstring)
        self.num_registered = len(hashes)  # leading full blocks already offered to the prefix index
        self.hashes = hashes  # chained hashes of leading full blocks (a cache)
        self.seal_from = sink  # blocks [sink, seal_from) are known to be q
        self.changed = 0  # table entries [changed, len) changed since the last table_delta()
        self.tier_from: list[int] = []  # age policy: blocks [sink, tier_from[t - 1]) were seen at tier t or lower

    def clone(self) -> SeqBlocks:
        s = SeqBlocks(list(self.tokens), list(self.table), self.num_computed, list(self.hashes), 0)
        s.num_settled, s.num_registered, s.seal_from = self.num_settled, self.num_registered, self.seal_from
        s.tier_from = list(self.tier_from)
        return s  # changed = 0: the clone's table is new to whoever mirrors it
