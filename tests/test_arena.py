"""The tier arena (kvq.cache.arena) and the tier rule (kvq.cache.tiers): layouts, slab trading,
and a stateful property test of the allocators against the bytes they hand out."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvq.cache.arena import ALIGN, MAX_WASTE, Arena, plan_arena, plane_offsets
from kvq.cache.block_allocator import NoFreeBlocksError, hash_block_tokens
from kvq.cache.plan import KVCacheConfig, bare_model, make_plan
from kvq.cache.tiers import TierRule, age_tier, pool_tier, protected, tier_pool


def layout_of(plan):
    m = plan.model
    return plan_arena([[plane_offsets(plan.tier_layers(t)[i], m.num_kv_heads, m.head_dim, plan.block_size)[1]
                        for i in range(m.num_layers)] for t in range(plan.num_tiers + 1)])


# -- the plan --------------------------------------------------------------------------------------
LLAMA8B = bare_model(32, 8, 128)


@pytest.mark.parametrize("base,tiers", [("fp8_e4m3", "int4_kivi"), ("fp8_e4m3", "int4_kivi,int2_kivi"),
                                        ("bf16", "fp8_e4m3"), ("int8_per_token_head", "turboquant_3bit_nc")])
def test_tier_bytes_shrink_and_windows_stay_out_of_the_lower_tiers(base, tiers):
    plan = make_plan(LLAMA8B, base, tiers=tiers)
    sizes = [plan.tier_bytes_per_block(t) for t in range(plan.num_tiers + 1)]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    assert plan.tier_names() == [make_plan(LLAMA8B, base).layers[0].name, *tiers.split(",")]
    assert plan.tier_rule.pressure and not plan.tier_rule.ages
    alone = make_plan(LLAMA8B, base)
    if "kivi" in tiers:  # KIVI's 4 sinks and 128-token window never move down, but stay in fp8_e4m3: it asks for
        # no high-precision window, and a ladder's windows in bf16 cost more than fp8_e4m3 alone held
        assert (plan.tier_rule.sink_blocks, plan.tier_rule.residual_tokens) == (1, 128)
        assert (plan.sink_tokens, plan.residual_tokens) == (alone.sink_tokens, alone.residual_tokens) == (0, 0)
        assert plan.hp_bytes_per_block == 0 or not plan.window_policy.sink_blocks
    given = make_plan(LLAMA8B, base, tiers=tiers, sink_tokens=4, residual_tokens=64)  # given windows: both
    assert (given.tier_rule.sink_blocks, given.tier_rule.residual_tokens) == (1, 64)
    if base != "bf16":
        assert (given.sink_tokens, given.residual_tokens) == (4, 64)


def test_tier_options_are_checked():
    with pytest.raises(ValueError, match="not fewer than"):
        make_plan(LLAMA8B, "int2_kivi", tiers="int4_kivi")
    with pytest.raises(ValueError, match="valid formats"):
        make_plan(LLAMA8B, "fp8_e4m3", tiers="int5")
    assert make_plan(LLAMA8B, "fp8_e4m3", tiers="rot3_kc").num_tiers == 1  # centred rotated K: a tier too
    with pytest.raises(ValueError, match="not fewer than"):
        make_plan(LLAMA8B, "rot3_kc", tiers="rot4_kc")
    with pytest.raises(ValueError, match="need --kv-cache-tiers"):
        KVCacheConfig(tier_age=(1024,))
    with pytest.raises(ValueError, match="needs --kv-tier-age"):
        KVCacheConfig(tiers=("int4_kivi",), tier_policy=("age",))
    with pytest.raises(ValueError, match="valid: age, pressure"):
        KVCacheConfig(tiers=("int4_kivi",), tier_policy=("oldest",))
    with pytest.raises(ValueError, match="inside the recent window"):
        KVCacheConfig("fp8_e4m3", tiers="int4_kivi", tier_age="100").plan(LLAMA8B)
    with pytest.raises(ValueError, match="one age per tier"):
        KVCacheConfig("fp8_e4m3", tiers="int4_kivi", tier_age="1024,2048").plan(LLAMA8B)


def test_tiered_plan_names_and_skipped_layers():
    plan = KVCacheConfig("fp8_e4m3", tiers="int4_kivi,int2_kivi", tier_age="1152", tier_policy="age,pressure",
                         skip_layers=(0,)).plan(LLAMA8B)
    assert plan.tier_rule.ages == (1152, 2304) and plan.tier_rule.pressure  # one age: tier t at t x age
    assert plan.name == "fp8_e4m3 (layer 0 in bfloat16)>int4_kivi>int2_kivi@1152/2304+pressure"
    # a format spec takes the name's suffix (how `kvq eval` names a tiered configuration)
    again = KVCacheConfig().with_spec("fp8_e4m3:r128:s4>int4_kivi>int2_kivi@1152/2304+pressure").plan(LLAMA8B)
    assert again.tier_rule == make_plan(LLAMA8B, "fp8_e4m3", tiers="int4_kivi,int2_kivi", tier_age=(1152, 2304),
                                        tier_policy="age,pressure", residual_tokens=128, sink_tokens=4).tier_rule
    assert KVCacheConfig().with_spec("bf16>fp8_e4m3").plan(LLAMA8B).tier_rule.policies == ("pressure",)
    with pytest.raises(ValueError, match="joined by '/'"):
        KVCacheConfig().with_spec("fp8_e4m3>int4_kivi@soon")
    for t in range(3):  # a skipped layer stays in the model dtype on every rung
        assert plan.tier_layers(t)[0] == plan.hp
    assert plan.describe()["tiers"] == ["int4_kivi", "int2_kivi"]


def test_age_rule_is_monotone_and_spares_the_windows():
    rule = TierRule(2, 16, sink_blocks=1, residual_tokens=32, ages=(64, 128))
    for i in range(12):
        states = [age_tier(i, n, rule) for n in range(200)]
        assert states == sorted(states), i  # a block only moves down as the sequence grows
        for n in range(200):
            if protected(i, n, rule):
                assert states[n] == 0
    assert age_tier(1, 32 + 64, rule) == 1 and age_tier(1, 32 + 63, rule) == 0  # block 1 ends at 32
    assert age_tier(1, 32 + 128, rule) == 2 and age_tier(0, 10_000, rule) == 0  # block 0 is a sink
    assert [tier_pool(t) for t in range(3)] == ["q", "q1", "q2"]
    assert [pool_tier(p) for p in ("q", "q1", "q2", "hp")] == [0, 1, 2, None]
    with pytest.raises(ValueError, match="unknown pool"):
        pool_tier("q0")


# -- layouts ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("base,tiers", [("fp8_e4m3", "int4_kivi"), ("fp8_e4m3", "int4_kivi,int2_kivi"),
                                        ("bf16", "fp8_e4m3"), ("bf16", "int4_kivi")])
def test_layout_places_every_tier_in_whole_slabs(base, tiers):
    plan = make_plan(LLAMA8B, base, tiers=tiers)
    lay = layout_of(plan)
    for t in range(plan.num_tiers + 1):
        for i in range(plan.model.num_layers):
            stride = lay.stride(t, i)
            assert stride * lay.per_slab[t] == lay.slab_bytes[i] and stride % ALIGN == 0
            assert stride >= lay.block_bytes[t][i]
        assert lay.waste(t) <= MAX_WASTE
    # bytes a token at full use: what the arena gives each tier, against the plan's bytes per block
    for t in range(plan.num_tiers + 1):
        held = lay.bytes_per_slab / lay.per_slab[t]
        assert plan.tier_bytes_per_block(t) <= held <= plan.tier_bytes_per_block(t) / (1 - MAX_WASTE)


def test_fp8_and_int4_kivi_share_slabs_exactly():
    """fp8_e4m3 : int4_kivi blocks are 8 : 5 in bytes at head dim 128: five of one in the bytes of eight."""
    lay = layout_of(make_plan(LLAMA8B, "fp8_e4m3", tiers="int4_kivi"))
    assert lay.per_slab == (5, 8) and lay.waste(0) == lay.waste(1) == 0


def test_planes_are_aligned_and_disjoint():
    fmt = make_plan(bare_model(2, 3, 64), "fp8_per_block").layers[0]
    planes, total = plane_offsets(fmt, 3, 64, 16)
    ends = [(off, off + p.nbytes) for _, p, off in planes]
    assert all(off % ALIGN == 0 for off, _ in ends) and total % ALIGN == 0
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))  # 12-byte scale planes padded to 16


# -- slab trading ----------------------------------------------------------------------------------
def test_demoting_frees_room_for_the_resident_tier():
    arena = Arena((5, 8), num_slabs=4, block_size=4, reserve_slabs=1)
    t0, t1 = arena.tiers
    assert t0.num_free == 15 and t0.available(True) == 20
    blocks = [t0.allocate() for _ in range(15)]
    with pytest.raises(NoFreeBlocksError):
        t0.allocate()
    # demote one slab's five blocks into the reserve: the slab empties and returns to the arena
    moved = [b for b in blocks if b // 5 == 0]
    for b in moved:
        t1.allocate(reserve_ok=True)
        t0.free(b)
    arena.check_integrity()
    assert arena.num_unowned == 1 and t0.num_free == 0 and t1.num_free == 3
    # the slab holds fp8 bytes that this step's demotions read: it goes to the int4 tier only from the
    # next step on (then wiped first)
    assert t1.available(True) == 3 and arena.take_wipes() == ()
    arena.begin_step()
    assert t1.available(True) == 3 + 8
    # once more: the second slab goes into the rest of the int4 slab and one new one
    for b in [b for b in blocks if b // 5 == 1]:
        t1.allocate(reserve_ok=True)
        t0.free(b)
    arena.check_integrity()
    assert t1.num_used == 10 and arena.slabs_of(1) == 2 and arena.num_unowned == 1
    assert arena.take_wipes() == (0,)  # the fp8 slab, now int4_kivi's
    arena.begin_step()
    # a third slab: fifteen fp8 blocks now sit in two int4 slabs, and a whole slab (5 fp8 blocks) is free
    for b in [b for b in blocks if b // 5 == 2]:
        t1.allocate(reserve_ok=True)
        t0.free(b)
    assert arena.slabs_of(1) == 2 and arena.num_unowned == 2 and t0.num_free == 5
    arena.check_integrity()


def test_cached_slabs_are_reclaimed_by_another_tier():
    arena = Arena((1, 2), num_slabs=2, block_size=2)
    t0, t1 = arena.tiers
    for tag in range(2):
        b = t1.allocate()
        assert t1.register(b, hash_block_tokens(None, [tag, tag]), [tag, tag])
        t1.free(b)  # cached-free: the slab is idle
    # the idle slab's blocks were written this step: another tier reclaims it from the next step on
    assert t1.num_cached == 2 and arena.slabs_of(1) == 1 and t0.num_free == 1
    arena.begin_step()
    assert t0.num_free == 2
    x, y = t0.allocate(), t0.allocate()  # the free slab, then the idle one (its cache evicted)
    arena.check_integrity()
    assert t1.num_cached == 0 and arena.slabs_of(0) == 2 and {x, y} == {0, 1}
    assert arena.take_wipes() == (0,)  # tier 1's slab, zeroed before tier 0 writes it
    assert t1.lookup(hash_block_tokens(None, [0, 0]), [0, 0]) is None


# -- the stateful property test --------------------------------------------------------------------
class ArenaMachine(RuleBasedStateMachine):
    """Random allocations, frees, prefix registrations and hits across three tiers; the arena
    must stay consistent, never hand out overlapping bytes, and ``available`` must be exact."""

    @initialize(per=st.sampled_from([(5, 8), (2, 3, 5), (1, 2), (3, 4, 9)]), slabs=st.integers(1, 5),
                reserve=st.integers(0, 1))
    def setup(self, per, slabs, reserve):
        self.arena = Arena(per, slabs, block_size=2, reserve_slabs=reserve)
        self.stride = [360 // n for n in per]  # a slab of 360 bytes (every per_slab divides it)
        self.held: list[tuple[int, int]] = []  # (tier, block) references we hold
        self.tag = 0
        self.touched: set[int] = set()  # slabs where this step's demotions freed a source
        # slabs the step reads or writes: a block handed out or hit in it, a demotion's source freed from it
        self.read_now: set[int] = set()
        self.bytes_of: list[int | None] = [None] * slabs  # the tier whose bytes each slab holds (None: zeros)

    def took(self, tier: int, block: int) -> None:
        """Tier ``tier`` handed out ``block``: its slab holds this tier's bytes, or is wiped now (and was
        not read in this step: the wipe runs before the step's reads)."""
        wiped = set(self.arena.take_wipes())
        for s in wiped:
            assert s not in self.read_now, (s, self.read_now)
            self.bytes_of[s] = None
        s = self.arena.tiers[tier].slab_of(block)
        assert self.bytes_of[s] in (None, tier), (s, self.bytes_of[s], tier, wiped)
        self.bytes_of[s] = tier
        self.read_now.add(s)  # (the step writes it)

    @rule(tier=st.integers(0, 2), reserve_ok=st.booleans(), register=st.booleans())
    def allocate(self, tier, reserve_ok, register):
        if tier >= len(self.arena.tiers):
            return
        t = self.arena.tiers[tier]
        can = t.available(reserve_ok)
        try:
            b = t.allocate(reserve_ok)
        except NoFreeBlocksError:
            assert can == 0
            return
        assert can > 0 and t.refcount(b) == 1
        self.took(tier, b)
        self.held.append((tier, b))
        if register:
            self.tag += 1
            t.register(b, hash_block_tokens(None, [self.tag, tier]), [self.tag, tier])

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 10_000))
    def free(self, i):
        tier, b = self.held.pop(i % len(self.held))
        self.arena.tiers[tier].free(b)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 10_000))
    def share(self, i):
        tier, b = self.held[i % len(self.held)]
        self.arena.tiers[tier].incref(b)
        self.held.append((tier, b))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 10_000), reserve_ok=st.booleans())
    def demote(self, i, reserve_ok):
        """A demotion: a block of the tier below for one we hold alone, the source discarded; the
        destination never lands in a slab where this step's demotions freed a source."""
        tier, b = self.held[i % len(self.held)]
        src = self.arena.tiers[tier]
        if tier + 1 >= len(self.arena.tiers) or src.refcount(b) != 1:
            return
        below = self.arena.tiers[tier + 1]
        can = below.available(reserve_ok, demotion=True)
        held = {s for s, o in enumerate(self.arena.owner) if o == tier + 1}
        try:
            new = below.allocate(reserve_ok, demotion=True)
        except NoFreeBlocksError:
            assert can == 0
            return
        # a slab it takes for it (not one it held) is none where this step's demotions freed a source
        assert can > 0 and (below.slab_of(new) in held or below.slab_of(new) not in self.touched)
        self.took(tier + 1, new)
        self.held.remove((tier, b))
        src.discard(b)
        self.touched.add(src.slab_of(b))
        self.read_now.add(src.slab_of(b))
        self.held.append((tier + 1, new))

    @rule()
    def next_step(self):
        self.arena.begin_step()
        self.touched.clear()
        self.read_now.clear()

    @rule(tag=st.integers(1, 30), tier=st.integers(0, 2))
    def hit(self, tag, tier):
        if tier >= len(self.arena.tiers):
            return
        b = self.arena.tiers[tier].lookup(hash_block_tokens(None, [tag, tier]), [tag, tier])
        if b is not None:
            self.held.append((tier, b))
            self.read_now.add(self.arena.tiers[tier].slab_of(b))

    @invariant()
    def consistent(self):
        self.arena.check_integrity()

    @invariant()
    def no_bytes_overlap(self):
        spans = []
        for t in self.arena.tiers:
            live = [b for b in range(t.num_blocks) if t.refcount(b) > 0 or t.block_hash(b) is not None]
            spans += [(b * self.stride[t.tier], (b + 1) * self.stride[t.tier]) for b in live]
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans

    @invariant()
    def available_is_exact(self):
        for tier in range(len(self.arena.tiers)):
            for reserve_ok, demotion in ((False, False), (True, False), (False, True), (True, True)):
                trial = copy.deepcopy(self.arena)
                t = trial.tiers[tier]
                n = t.available(reserve_ok, demotion)
                held = {s for s, o in enumerate(trial.owner) if o == tier}
                for _ in range(n):
                    got = t.allocate(reserve_ok, demotion)
                    assert not demotion or t.slab_of(got) in held or t.slab_of(got) not in self.touched
                    held.add(t.slab_of(got))
                with pytest.raises(NoFreeBlocksError):
                    t.allocate(reserve_ok, demotion)


TestArenaMachine = ArenaMachine.TestCase
TestArenaMachine.settings = settings(max_examples=100, stateful_step_count=25, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


def test_capacity_counts_aged_blocks_in_their_tier():
    """At 8192 tokens, an fp8_e4m3 cache whose blocks older than 1152 tokens age into int4_kivi holds
    nearly int4_kivi's sequences: the per-sequence bytes add each block at its tier's size."""
    caps = {spec: KVCacheConfig().with_spec(spec).plan(LLAMA8B).capacity(8 << 30, 8192)
            for spec in ("fp8_e4m3:r128:s4", "fp8_e4m3:r128:s4>int4_kivi@1152", "int4_kivi")}
    fp8, aged, int4 = caps.values()
    assert fp8.sequences < aged.sequences <= int4.sequences
    plan = KVCacheConfig().with_spec("fp8_e4m3:r128:s4>int4_kivi@1152").plan(LLAMA8B)
    q, hp = plan.blocks_for(8192)
    young = (1152 - 128) // 32  # sealed blocks less than 1152 tokens behind the head stay fp8_e4m3
    assert aged.bytes_per_sequence == (hp * plan.hp_bytes_per_block + young * plan.tier_bytes_per_block(0)
                                       + (q - young) * plan.tier_bytes_per_block(1))
