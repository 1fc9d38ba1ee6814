"""One pool of physical KV blocks: refcounts, an LRU of evictable cached blocks, a prefix index.

The allocator holds no tensors. It hands out block ids ``0 .. num_blocks-1``
and remembers, for every id, a reference count and (optionally) the content
hash of the full block of tokens whose KV the block holds.

Every block is in exactly one of three states::

    free         refcount == 0, no hash       -> handed out first by allocate()
    cached-free  refcount == 0, holds a hash  -> evictable, LRU order; a prefix
                                                 lookup can revive it
    used         refcount >= 1, hash or not

    num_free (allocatable) = len(free) + len(cached-free)
    num_free + num_used == num_blocks

Invariants (checked by :meth:`BlockAllocator.check_integrity`):

* the three sets are disjoint and cover every block id; the free list holds no
  id twice;
* a block holds a hash iff the prefix index maps that hash to that block
  (the index is a bijection between indexed hashes and hash-holding blocks);
* a hash-holding block also stores its ``block_size`` token ids, so that a
  lookup can verify them and reject hash collisions;
* with prefix caching disabled the index and the cached-free set stay empty.

Content hashes chain a block to its parent (the previous block of the same
sequence) through :func:`hash_block_tokens`, so equal hashes mean equal
prefixes, not just equal blocks.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

_HASH_DOMAIN = b"kvq.block.v1\x00"


class NoFreeBlocksError(RuntimeError):
    """Raised when a pool has neither a free nor an evictable cached block."""


def _encode(item: object, out: list[bytes]) -> None:
    """Append a stable, self-delimiting byte encoding of ``item`` to ``out``."""
    if item is None:
        out.append(b"N")
    elif isinstance(item, bool):  # before int: bool is an int subclass
        out.append(b"T" if item else b"F")
    elif isinstance(item, int):
        raw = item.to_bytes((item.bit_length() + 8) // 8 or 1, "little", signed=True)
        out.append(b"I" + struct.pack("<I", len(raw)) + raw)
    elif isinstance(item, str):
        raw = item.encode("utf-8")
        out.append(b"S" + struct.pack("<I", len(raw)) + raw)
    elif isinstance(item, bytes):
        out.append(b"B" + struct.pack("<I", len(item)) + item)
    elif isinstance(item, float):
        out.append(b"D" + struct.pack("<d", item))
    elif isinstance(item, tuple):
        out.append(b"(" + struct.pack("<I", len(item)))
        for sub in item:
            _encode(sub, out)
    else:
        raise TypeError(
            f"cannot hash extra key item of type {type(item).__name__}; "
            "use None, bool, int, float, str, bytes or tuples of them"
        )


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int], extra: tuple = ()) -> int:
    """Content hash of one block of tokens, chained to its parent block's hash.

    Deterministic across processes and machines (SHA-256 over a fixed
    little-endian encoding; never Python's salted ``hash()``). ``parent_hash`` is
    ``None`` for the first block of a sequence. ``extra`` distinguishes caches
    that must not share blocks although the tokens agree (e.g. an adapter id).
    Token ids must fit in a signed 64-bit integer. Returns a 256-bit int.
    """
    parts: list[bytes] = [_HASH_DOMAIN]
    _encode(parent_hash, parts)
    try:
        parts.append(struct.pack(f"<Q{len(token_ids)}q", len(token_ids), *token_ids))
    except struct.error as exc:
        raise ValueError(f"token ids must be ints in the signed 64-bit range: {exc}") from None
    _encode(tuple(extra), parts)
    return int.from_bytes(hashlib.sha256(b"".join(parts)).digest(), "little")


class BlockAllocator:
    """Reference-counted pool of ``num_blocks`` blocks of ``block_size`` tokens.

    Contract:

    * :meth:`allocate` returns a block with refcount 1, taking a free block
      first and otherwise evicting the least recently freed cached block
      (its hash leaves the index); :class:`NoFreeBlocksError` if neither exists.
    * :meth:`incref` adds a reference to a used block; :meth:`free` drops one.
      At refcount 0 a hash-holding block becomes cached-free (most recently
      used end of the LRU), any other block becomes free.
    * :meth:`register` / :meth:`lookup` / :meth:`peek` / :meth:`probe` form the
      prefix cache; they are no-ops (lookups miss) when prefix caching is off.

    Misuse (bad id, double free, incref of an unreferenced block, registering a
    partial block) raises ``ValueError``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, name: str = "pool"):
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"{name}: num_blocks must be an int >= 0, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"{name}: block_size must be an int >= 1, got {block_size!r}")
        self.name = name
        self.block_size = block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._num_blocks = num_blocks
        self._refcount = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks  # hash held by each block
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # its tokens, for verification
        # Stack of free ids; reversed so that a fresh pool hands out 0, 1, 2, ...
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()  # cached-free ids, LRU first
        self._index: dict[int, int] = {}  # hash -> the block holding it
        self._num_used = 0
        self.num_hits = 0  # lookups that returned a block
        self.num_misses = 0  # lookups that did not

    # -- counters ---------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free(self) -> int:
        """Allocatable blocks: free plus cached-free (evictable)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Cached-free blocks: refcount 0, content kept for prefix reuse until evicted."""
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self._num_used

    @property
    def hit_rate(self) -> float:
        total = self.num_hits + self.num_misses
        return self.num_hits / total if total else 0.0

    def refcount(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._refcount[block_id]

    def block_hash(self, block_id: int) -> int | None:
        """The content hash ``block_id`` is indexed under, or None."""
        self._check_id(block_id)
        return self._hash[block_id]

    def block_tokens(self, block_id: int) -> tuple[int, ...] | None:
        """The token ids stored with ``block_id``'s hash, or None if it holds no hash."""
        self._check_id(block_id)
        return self._tokens[block_id]

    # -- allocation -------------------------------------------------------------------------
    def allocate(self) -> int:
        """Return a block with refcount 1; raise NoFreeBlocksError if the pool is exhausted."""
        if self._free:
            block_id = self._free.pop()
        elif self._cached:
            block_id, _ = self._cached.popitem(last=False)  # least recently freed
            self._drop_hash(block_id)
        else:
            raise NoFreeBlocksError(
                f"{self.name}: no free blocks ({self._num_blocks} total, all in use)"
            )
        assert self._refcount[block_id] == 0, (self.name, block_id, self._refcount[block_id])
        self._refcount[block_id] = 1
        self._num_used += 1
        return block_id

    def incref(self, block_id: int) -> None:
        """Add a reference to a used block (fork / share)."""
        self._check_id(block_id)
        if self._refcount[block_id] == 0:
            raise ValueError(f"{self.name}: incref of block {block_id}, which has no reference (use lookup)")
        self._refcount[block_id] += 1

    def free(self, block_id: int) -> None:
        """Drop one reference; at zero the block becomes cached-free (if hashed) or free."""
        self._check_id(block_id)
        rc = self._refcount[block_id]
        if rc == 0:
            raise ValueError(f"{self.name}: double free of block {block_id} (refcount is already 0)")
        self._refcount[block_id] = rc - 1
        if rc == 1:
            self._num_used -= 1
            if self._hash[block_id] is not None:
                self._cached[block_id] = None  # most recently used end
            else:
                self._free.append(block_id)

    def forget(self, block_id: int) -> None:
        """Take a block's hash out of the prefix index (its content is not what the hash says: a failed
        copy): a used one becomes free, not cached, when its last reference goes; a cached-free one
        is free at once."""
        self._check_id(block_id)
        if self._hash[block_id] is None:
            return
        self._drop_hash(block_id)
        if self._refcount[block_id] == 0:
            del self._cached[block_id]
            self._freed(block_id)

    def _drop_hash(self, block_id: int) -> None:
        """Take a hash-holding block's hash and tokens out of the prefix index."""
        del self._index[self._hash[block_id]]
        self._hash[block_id] = None
        self._tokens[block_id] = None

    def _freed(self, block_id: int) -> None:
        """A cached-free block whose hash is gone: free now."""
        self._free.append(block_id)

    # -- prefix cache -----------------------------------------------------------------------
    def register(self, block_id: int, block_hash: int, token_ids: Sequence[int]) -> bool:
        """Record that used, full block ``block_id`` holds the tokens ``token_ids``.

        Returns True if the block is (now, or already) indexed under
        ``block_hash``; False if prefix caching is off or another block already
        holds that hash (the existing block stays indexed, this one stays
        unregistered). A block's content is immutable once registered: a second
        registration under a different hash raises ValueError.
        """
        self._check_id(block_id)
        if self._refcount[block_id] == 0:
            raise ValueError(f"{self.name}: register of unreferenced block {block_id}")
        if len(token_ids) != self.block_size:
            raise ValueError(
                f"{self.name}: only full blocks are registered ({len(token_ids)} tokens, block size {self.block_size})"
            )
        if not self.enable_prefix_caching:
            return False
        held = self._hash[block_id]
        if held is not None:
            if held != block_hash:
                raise ValueError(f"{self.name}: block {block_id} already holds a different hash")
            return True
        if block_hash in self._index:
            return False
        self._index[block_hash] = block_id
        self._hash[block_id] = block_hash
        self._tokens[block_id] = tuple(token_ids)
        return True

    def probe(self, block_hash: int, token_ids: Sequence[int]) -> int | None:
        """The block holding ``block_hash`` with exactly ``token_ids``, or None.

        Takes no reference and touches no counter or LRU order.
        """
        if not self.enable_prefix_caching:
            return None
        block_id = self._index.get(block_hash)
        if block_id is None or self._tokens[block_id] != tuple(token_ids):
            return None  # unknown, or a hash collision with different tokens
        return block_id

    def peek(self, block_hash: int, token_ids: Sequence[int]) -> bool:
        """Whether :meth:`lookup` would hit, without taking a reference."""
        return self.probe(block_hash, token_ids) is not None

    def note_miss(self) -> None:
        """Count a prefix lookup that found nothing usable without looking it up."""
        self.num_misses += 1

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> int | None:
        """Return the verified cached block and give the caller a reference, or None.

        A cached-free block moves back to used. Counts a hit or a miss (only
        while prefix caching is on).
        """
        if not self.enable_prefix_caching:
            return None
        block_id = self.probe(block_hash, token_ids)
        if block_id is None:
            self.num_misses += 1
            return None
        self.num_hits += 1
        if self._refcount[block_id] == 0:
            del self._cached[block_id]
            self._num_used += 1
        self._refcount[block_id] += 1
        return block_id

    # -- checks -----------------------------------------------------------------------------
    def _check_id(self, block_id: int) -> None:
        if not isinstance(block_id, int) or not 0 <= block_id < self._num_blocks:
            raise ValueError(f"{self.name}: block id {block_id!r} out of range 0..{self._num_blocks - 1}")

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant (see module docstring)."""

        def fail(msg: str) -> None:
            raise AssertionError(f"{self.name}: {msg}")

        n = self._num_blocks
        if len(self._refcount) != n or len(self._hash) != n or len(self._tokens) != n:
            fail("per-block arrays do not have num_blocks entries")
        free = set(self._free)
        if len(free) != len(self._free):
            fail(f"a block id appears twice in the free list: {sorted(self._free)}")
        cached = set(self._cached)
        used = {b for b in range(n) if self._refcount[b] > 0}
        if any(rc < 0 for rc in self._refcount):
            fail("negative refcount")
        if free & cached or free & used or cached & used:
            fail(f"state sets overlap: free&cached={free & cached}, free&used={free & used}, "
                 f"cached&used={cached & used}")
        if len(free) + len(cached) + len(used) != n:
            missing = set(range(n)) - free - cached - used
            fail(f"free {len(free)} + cached {len(cached)} + used {len(used)} != total {n}; missing {sorted(missing)}")
        if self._num_used != len(used):
            fail(f"num_used counter {self._num_used} != {len(used)} blocks with refcount >= 1")
        for b in free:
            if self._hash[b] is not None or self._tokens[b] is not None:
                fail(f"free block {b} holds a hash")
        for b in cached:
            if self._hash[b] is None:
                fail(f"cached-free block {b} holds no hash")
        for h, b in self._index.items():
            if not 0 <= b < n or self._hash[b] != h:
                fail(f"index maps a hash to block {b}, which does not hold it")
        for b in range(n):
            h = self._hash[b]
            if h is None:
                if self._tokens[b] is not None:
                    fail(f"block {b} stores tokens but no hash")
                continue
            if self._index.get(h) != b:
                fail(f"block {b} holds a hash that the index does not map to it")
            if self._tokens[b] is None or len(self._tokens[b]) != self.block_size:
                fail(f"block {b} holds a hash without a full block of tokens")
        if not self.enable_prefix_caching and (self._index or self._cached):
            fail("prefix caching is off but the index or the cached set is not empty")

    def __repr__(self) -> str:
        return (
            f"BlockAllocator({self.name!r}, blocks={self._num_blocks}, block_size={self.block_size}, "
            f"free={len(self._free)}, cached={len(self._cached)}, used={self._num_used})"
        )
