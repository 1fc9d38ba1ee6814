"""BlockAllocator: unit tests and a stateful property test against a small model."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvq.cache.block_allocator import BlockAllocator, NoFreeBlocksError, hash_block_tokens


def full(alloc: BlockAllocator, tag: int) -> list[int]:
    return [tag] * alloc.block_size


def counts(a: BlockAllocator) -> tuple[int, int, int]:
    return a.num_free, a.num_used, a.num_cached


# -- hashing --------------------------------------------------------------------------------
def test_hash_is_deterministic_across_processes():
    here = hash_block_tokens(hash_block_tokens(None, [1, 2, 3]), [4, 5, 6], extra=("lora", 7))
    code = (
        "from kvq.cache.block_allocator import hash_block_tokens as h;"
        "print(h(h(None, [1, 2, 3]), [4, 5, 6], extra=('lora', 7)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PYTHONPATH": ":".join(sys.path)})
    assert int(out.stdout) == here


def test_hash_distinguishes_parent_tokens_and_extra():
    base = hash_block_tokens(None, [1, 2])
    assert base == hash_block_tokens(None, (1, 2))
    assert len({base, hash_block_tokens(0, [1, 2]), hash_block_tokens(None, [2, 1]),
                hash_block_tokens(None, [1, 2], extra=(1,)), hash_block_tokens(None, [1, 2, 0]),
                hash_block_tokens(base, [1, 2])}) == 6


def test_hash_rejects_bad_input():
    with pytest.raises(ValueError):
        hash_block_tokens(None, [2**70])
    with pytest.raises(TypeError):
        hash_block_tokens(None, [1], extra=(object(),))


# -- allocation -----------------------------------------------------------------------------
def test_allocate_free_counts_and_exhaustion():
    a = BlockAllocator(3, 2)
    assert counts(a) == (3, 0, 0) and a.num_blocks == 3
    ids = [a.allocate() for _ in range(3)]
    assert sorted(ids) == [0, 1, 2] and counts(a) == (0, 3, 0)
    with pytest.raises(NoFreeBlocksError):
        a.allocate()
    assert issubclass(NoFreeBlocksError, RuntimeError)
    a.free(ids[1])
    assert counts(a) == (1, 2, 0)
    assert a.allocate() == ids[1]
    a.check_integrity()


def test_double_free_and_bad_ids():
    a = BlockAllocator(2, 2)
    b = a.allocate()
    a.free(b)
    with pytest.raises(ValueError, match="double free"):
        a.free(b)
    for bad in (-1, 2, "0"):
        with pytest.raises(ValueError):
            a.free(bad)
    with pytest.raises(ValueError):
        a.incref(b)  # unreferenced: revive only through lookup
    with pytest.raises(ValueError):
        BlockAllocator(-1, 2)
    with pytest.raises(ValueError):
        BlockAllocator(2, 0)
    a.check_integrity()


def test_incref_shares_until_last_free():
    a = BlockAllocator(2, 2)
    b = a.allocate()
    a.incref(b)
    assert a.refcount(b) == 2
    a.free(b)
    assert a.refcount(b) == 1 and a.num_used == 1
    a.free(b)
    assert a.num_used == 0 and a.num_free == 2


def test_cached_blocks_evicted_in_lru_order_after_free_ones():
    a = BlockAllocator(4, 2)
    ids = [a.allocate() for _ in range(4)]
    for tag, b in enumerate(ids[:3]):
        assert a.register(b, 100 + tag, full(a, tag))
    for b in (ids[1], ids[0], ids[2], ids[3]):  # ids[3] holds no hash -> plain free
        a.free(b)
    assert counts(a) == (4, 0, 3)
    assert a.allocate() == ids[3]  # free list before any eviction
    assert a.allocate() == ids[1]  # least recently freed cached block
    assert a.peek(101, full(a, 1)) is False  # its hash left the index
    assert a.peek(100, full(a, 0)) and a.peek(102, full(a, 2))
    # A hit refreshes nothing by itself, but a later free puts the block at the MRU end.
    assert a.lookup(100, full(a, 0)) == ids[0]
    a.free(ids[0])
    assert a.allocate() == ids[2]
    assert a.allocate() == ids[0]
    a.check_integrity()


def test_lookup_revives_cached_block_and_counts():
    a = BlockAllocator(2, 2)
    b = a.allocate()
    assert a.register(b, 7, [1, 2])
    a.free(b)
    assert counts(a) == (2, 0, 1)
    assert a.lookup(7, [1, 2]) == b
    assert a.refcount(b) == 1 and counts(a) == (1, 1, 0)
    assert a.lookup(7, [1, 2]) == b and a.refcount(b) == 2
    assert a.lookup(8, [1, 2]) is None
    assert (a.num_hits, a.num_misses) == (2, 1) and a.hit_rate == pytest.approx(2 / 3)
    a.check_integrity()


def test_lookup_rejects_hash_collision():
    """A fabricated hash shared by blocks with different tokens never returns the wrong block."""
    a = BlockAllocator(3, 2)
    b = a.allocate()
    assert a.register(b, 42, [1, 2])
    assert a.lookup(42, [9, 9]) is None and not a.peek(42, [9, 9]) and a.probe(42, [9, 9]) is None
    other = a.allocate()
    assert a.register(other, 42, [9, 9]) is False  # the first holder stays indexed
    assert a.block_hash(other) is None
    a.free(other)
    assert a.num_cached == 0  # unregistered block went straight to free
    assert a.lookup(42, [1, 2]) == b
    a.check_integrity()


def test_register_contract():
    a = BlockAllocator(2, 2)
    b = a.allocate()
    with pytest.raises(ValueError, match="full"):
        a.register(b, 1, [1])
    assert a.register(b, 1, [1, 2]) and a.register(b, 1, [1, 2])  # idempotent
    with pytest.raises(ValueError):
        a.register(b, 2, [1, 2])
    a.free(b)
    with pytest.raises(ValueError):
        a.register(b, 1, [1, 2])  # unreferenced


def test_prefix_caching_disabled():
    a = BlockAllocator(2, 2, enable_prefix_caching=False)
    b = a.allocate()
    assert a.register(b, 1, [1, 2]) is False
    assert a.lookup(1, [1, 2]) is None and not a.peek(1, [1, 2])
    a.free(b)
    assert counts(a) == (2, 0, 0) and (a.num_hits, a.num_misses) == (0, 0)
    a.check_integrity()


def test_check_integrity_detects_corruption():
    a = BlockAllocator(3, 2)
    b = a.allocate()
    a._free.append(a._free[-1])
    with pytest.raises(AssertionError, match="twice"):
        a.check_integrity()
    a._free.pop()
    a._refcount[b] = 0
    with pytest.raises(AssertionError):
        a.check_integrity()
    a._refcount[b] = 1
    a._index[5] = b
    with pytest.raises(AssertionError, match="does not hold"):
        a.check_integrity()


def test_zero_block_pool():
    a = BlockAllocator(0, 4)
    assert counts(a) == (0, 0, 0)
    with pytest.raises(NoFreeBlocksError):
        a.allocate()
    a.check_integrity()


# -- stateful -------------------------------------------------------------------------------
class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/incref/free/register/lookup against a model of refcounts and the index."""

    BS = 2

    @initialize(num_blocks=st.integers(0, 5), prefix=st.booleans())
    def setup(self, num_blocks, prefix):
        self.a = BlockAllocator(num_blocks, self.BS, enable_prefix_caching=prefix)
        self.prefix = prefix
        self.rc: dict[int, int] = {b: 0 for b in range(num_blocks)}
        self.content: dict[int, tuple[int, tuple]] = {}  # block -> (hash, tokens) it holds
        self.lru: list[int] = []  # cached-free blocks, oldest first

    def used(self):
        return sorted(b for b, c in self.rc.items() if c > 0)

    @rule()
    def allocate(self):
        free_plain = [b for b, c in self.rc.items() if c == 0 and b not in self.content]
        if not free_plain and not self.lru:
            with pytest.raises(NoFreeBlocksError):
                self.a.allocate()
            return
        b = self.a.allocate()
        assert self.rc[b] == 0
        if not free_plain:
            assert b == self.lru.pop(0), "eviction must take the least recently freed cached block"
            del self.content[b]
        else:
            assert b not in self.content
        self.rc[b] = 1

    @rule(data=st.data())
    def incref(self, data):
        if not self.used():
            return
        b = data.draw(st.sampled_from(self.used()))
        self.a.incref(b)
        self.rc[b] += 1

    @rule(data=st.data())
    def free(self, data):
        if not self.used():
            return
        b = data.draw(st.sampled_from(self.used()))
        self.a.free(b)
        self.rc[b] -= 1
        if self.rc[b] == 0 and b in self.content:
            self.lru.append(b)

    @rule(data=st.data())
    def retire(self, data):
        """Register a used block under a fresh hash and drop all its references: it becomes cached."""
        if not self.used():
            return
        b = data.draw(st.sampled_from(self.used()))
        if self.prefix and b not in self.content:
            self.fresh = getattr(self, "fresh", 100) + 1
            tokens = (self.fresh,) * self.BS
            assert self.a.register(b, self.fresh, tokens)
            self.content[b] = (self.fresh, tokens)
        while self.rc[b]:
            self.a.free(b)
            self.rc[b] -= 1
        if b in self.content:
            self.lru.append(b)

    @rule(data=st.data())
    def double_free(self, data):
        unused = [b for b, c in self.rc.items() if c == 0]
        if unused:
            with pytest.raises(ValueError):
                self.a.free(data.draw(st.sampled_from(unused)))

    @rule(data=st.data(), h=st.integers(0, 5), tok=st.integers(0, 2))
    def register(self, data, h, tok):
        if not self.used():
            return
        b = data.draw(st.sampled_from(self.used()))
        tokens = (tok,) * self.BS
        if b in self.content and self.content[b][0] != h:
            with pytest.raises(ValueError):
                self.a.register(b, h, tokens)
            return
        ok = self.a.register(b, h, tokens)
        if not self.prefix:
            assert ok is False
            return
        holder = next((x for x, (hh, _) in self.content.items() if hh == h), None)
        assert ok == (holder in (None, b))
        if holder is None:
            self.content[b] = (h, tokens)

    @rule(data=st.data(), h=st.integers(0, 5), tok=st.integers(0, 2))
    def lookup(self, data, h, tok):
        tokens = (tok,) * self.BS
        if self.content and data.draw(st.booleans()):  # a key some block holds
            h, tokens = data.draw(st.sampled_from(sorted(self.content.values())))
        if self.content and data.draw(st.booleans()):  # an indexed hash with other tokens: a collision
            h, held = data.draw(st.sampled_from(sorted(self.content.values())))
            tokens = tuple(t + 1 for t in held)
        expect = next((b for b, (hh, tt) in self.content.items() if hh == h and tt == tokens), None)
        assert self.a.peek(h, tokens) == (expect is not None)
        hits = self.a.num_hits
        got = self.a.lookup(h, tokens)
        assert got == expect
        if got is not None:
            assert self.a.num_hits == hits + 1
            if self.rc[got] == 0:
                self.lru.remove(got)
            self.rc[got] += 1

    @invariant()
    def consistent(self):
        if not hasattr(self, "a"):
            return
        self.a.check_integrity()
        a = self.a
        assert a.num_used == len(self.used())
        assert a.num_cached == len(self.lru)
        assert a.num_free + a.num_used == a.num_blocks
        assert list(a._cached) == self.lru
        for b, c in self.rc.items():
            assert a.refcount(b) == c
            assert a.block_hash(b) == (self.content[b][0] if b in self.content else None)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
