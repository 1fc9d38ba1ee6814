"""Demotion (elastic precision): a block re-stored one tier down holds exactly the codes a direct
quantization of its dequantized source gives, in the reference and in the Triton kernel, and
writing one tier's blocks never touches another tier's bytes in the shared arena.

K/V are real (tests/fixtures/kv_smollm2.pt: SmolLM2-135M, 3 KV heads, head_dim 64, outlier
channels included), sealed into the resident tier by the reference quantizer first.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvq.attention import reference
from kvq.attention.triton import demote as triton_demote
from kvq.cache.plan import bare_model, make_plan
from kvq.cache.pool import KVPool
from kvq.formats import fp8
from kvq.formats.reference import dequantize, quantize

FIXTURE = Path(__file__).parent / "fixtures" / "kv_smollm2.pt"
SLABS = 9
FILL, SEED, DEST = 3, 3, 6  # slabs: resident blocks 0-2 hold K/V; lower-tier sources from 3; destinations from 6

#: (resident format, tiers, demotions (source tier, destination tier) to check)
LADDERS = [
    ("fp8_e4m3", "int4_kivi,int2_kivi", [(0, 1), (1, 2), (0, 2)]),
    ("bfloat16", "fp8_e4m3", [(0, 1)]),
    ("int8_per_token_head", "int4_per_token", [(0, 1)]),
    ("fp8_per_block", "turboquant_4bit_nc", [(0, 1)]),
    ("turboquant_4bit_nc", "turboquant_3bit_nc", [(0, 1)]),
    ("fp8_e4m3", "rot4_kc,rot3_kc", [(0, 1), (1, 2)]),  # centred K: its means' plane in the arena too
]


@pytest.fixture(scope="module")
def kv():
    data = torch.load(FIXTURE, weights_only=True)
    return data["k"][1:3], data["v"][1:3]  # two layers: [2, 896, 3, 64] bf16


def filled(base: str, tiers: str, kv, device="cpu") -> KVPool:
    """A tiered pool whose resident blocks of slabs 0-2 hold real K/V, sealed."""
    k, v = kv
    L, T, H, D = k.shape
    plan = make_plan(bare_model(L, H, D), base, tiers=tiers)
    pool = KVPool.create(plan, 0, 0, device, num_slabs=SLABS)
    n, bs = FILL * pool.layout.per_slab[0], plan.block_size
    assert n * bs <= T
    for i, layer in enumerate(pool.layers):  # static scales of each layer's own (one launch reads both)
        layer.k_scale.fill_(0.25 * (i + 1))
        layer.v_scale.fill_(0.125 * (i + 2))
        blocks = [x[i, :n * bs].reshape(n, bs, H, D).transpose(1, 2).contiguous().to(device) for x in (k, v)]
        ids = torch.arange(n, device=device)
        reference.seal_blocks(replace(layer, k_hp=blocks[0], v_hp=blocks[1]), ids, ids)
    return pool


def planes_of(layer, tier: int, ids) -> dict[str, torch.Tensor]:
    lt = layer.tier(tier)
    idx = torch.as_tensor(ids)
    return {f"{role}.{name}": fp8.as_bytes(fp8.index_select(t, 0, idx)).clone()
            for role in ("k", "v") for name, t in lt.planes(role).items()}


def expected(layer, src: int, dst: int, src_ids) -> dict[str, torch.Tensor]:
    """Direct quantization into tier ``dst`` of tier ``src``'s blocks, dequantized (float32)."""
    s, d = layer.tier(src), layer.tier(dst)
    idx = torch.as_tensor(src_ids)
    out = {}
    for role in ("k", "v"):
        planes = {name: fp8.index_select(t, 0, idx) for name, t in s.planes(role).items()}
        x = dequantize(s.tensor_format(role), planes, layer.static_scale(role), torch.float32)
        for name, val in quantize(d.tensor_format(role), x, layer.static_scale(role)).items():
            out[f"{role}.{name}"] = fp8.as_bytes(val)
    return out


def arena_bytes(pool: KVPool) -> list[torch.Tensor]:
    return [layer.arena.clone() for layer in pool.layers]


def slab_span(pool: KVPool, layer: int, tier: int, first: int, blocks: int) -> slice:
    """Bytes of the slabs that ``blocks`` blocks of ``tier`` from slab ``first`` on occupy."""
    s, per = pool.layout.slab_bytes[layer], pool.layout.per_slab[tier]
    return slice(first * s, (first + -(-blocks // per)) * s)


def ids_from(pool: KVPool, tier: int, slab: int, order=(0, 1, 2)) -> list[int]:
    return [slab * pool.layout.per_slab[tier] + j for j in order]


def seed(pool: KVPool, tier: int) -> None:
    """Demote resident blocks 0-2 into ``tier`` from slab SEED on (sources of a lower tier)."""
    pairs = torch.tensor(list(zip(range(3), ids_from(pool, tier, SEED))), device=pool.device)
    for layer in pool.layers:
        reference.demote_pairs(layer, pairs, 0, tier)


@pytest.mark.parametrize("base,tiers,moves", LADDERS, ids=[f"{b}>{t}" for b, t, _ in LADDERS])
def test_reference_demotion_is_a_direct_quantization_of_the_dequantized_block(base, tiers, moves, kv):
    pool = filled(base, tiers, kv)
    for src, dst in moves:
        if src:
            seed(pool, src)
        src_ids = ids_from(pool, src, SEED if src else 0, (2, 0, 1))
        dst_ids = ids_from(pool, dst, DEST, (0, 2, 1))
        pairs = torch.tensor([*zip(src_ids, dst_ids), (src_ids[0], -1)])  # a padding row: skipped
        before = arena_bytes(pool)
        want = [expected(layer, src, dst, src_ids) for layer in pool.layers]
        for layer in pool.layers:
            reference.demote_pairs(layer, pairs, src, dst)
        for i, layer in enumerate(pool.layers):
            got = planes_of(layer, dst, dst_ids)
            assert got.keys() == want[i].keys()
            for name in got:
                assert torch.equal(got[name], want[i][name]), (src, dst, name)
            # only the destination slabs changed: every other tier's bytes in the arena are intact
            changed = (layer.arena != before[i]).nonzero().flatten()
            span = slab_span(pool, i, dst, DEST, 3)
            assert changed.numel() and span.start <= int(changed.min()) and int(changed.max()) < span.stop


@pytest.mark.parametrize("base,tiers,moves", LADDERS, ids=[f"{b}>{t}" for b, t, _ in LADDERS])
def test_triton_demotion_matches_the_reference(base, tiers, moves, kv):
    """The Triton kernel (on a GPU, else under the interpreter) writes the reference's bytes (on the CPU),
    both layers in one launch (each layer's planes at its own arena's and static scales' distance)."""
    rotated = "turboquant" in base + tiers or "rot" in tiers
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for src, dst in moves[:2]:
        pools = [filled(base, tiers, kv), filled(base, tiers, kv, dev)]
        if src:
            for pool in pools:
                seed(pool, src)
        s, d = ids_from(pools[0], src, SEED if src else 0), ids_from(pools[0], dst, DEST)
        pairs = torch.tensor([(s[1], d[0]), (s[0], -1), (s[2], d[1])])
        for layer in pools[0].layers:
            reference.demote_pairs(layer, pairs, src, dst)
        assert len(triton_demote._groups(pools[1].layers, src, dst)) == 1
        triton_demote.demote_layers(pools[1].layers, pairs.to(dev), src, dst)
        for ref, tri in zip(pools[0].layers, pools[1].layers):
            diff = (ref.arena != tri.arena.cpu()).sum().item()
            if rotated:  # the rotation's float32 sums run in another order: a code may flip at a level's edge
                assert diff <= 1e-3 * ref.arena.numel(), diff
            else:
                assert diff == 0, (src, dst, diff)


def test_a_decode_graph_runs_the_steps_demotions_from_its_static_lists(kv):
    """A decode graph launches each layer's demotions of every ordered pair of tiers from static lists
    (kvq.engine.cuda_graphs), refilled before each replay and padded with destination -1: what it runs
    writes the bytes the step's own demotion runs write.  It serves steps within the lists, not one that
    moves a block twice (order) nor one with more demotions of a pair than a list holds."""
    from kvq.cache.step import HostStep
    from kvq.engine.cuda_graphs import DEMOTES_PER_PAIR, DecodeGraphs

    base, tiers = "fp8_e4m3", "int4_kivi,int2_kivi"
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pools = [filled(base, tiers, kv), filled(base, tiers, kv)]
    for pool in pools:
        seed(pool, 1)
    launched = filled(base, tiers, kv, dev)  # the graph's side runs on the device: pools[0]'s bytes there
    for a, b in zip(launched.layers, pools[0].layers):
        a.arena.copy_(b.arena)
    graphs = DecodeGraphs(None, launched, None, dev, max_batch=4, max_model_len=256, null_block=0, has_hp=False)
    assert graphs.demote_pairs == [(0, 1), (0, 2), (1, 2)]
    p = pools[0]
    t2 = ids_from(p, 2, DEST + 1)  # (a slab holds one tier's blocks)
    runs = ((1, 2, [(ids_from(p, 1, SEED)[0], t2[0])]),  # (deepest first, as the manager makes them)
            (0, 1, [(0, ids_from(p, 1, DEST)[0]), (2, ids_from(p, 1, DEST)[1])]),
            (0, 2, [(1, t2[1])]))
    step = HostStep(slots=[0, 1], tables=[[0], [1]], seq_lens=[1, 1], num_new=[1, 1], demotes=runs)
    assert graphs.serves(step)
    graphs.stage([0, 0], [0, 0], step)
    meta = graphs._meta(2)
    assert [(s, d) for s, d, _ in meta.demotes] == graphs.demote_pairs
    for layer in launched.layers:  # the graph's launches: every pair, padded lists
        for s, d, lst in meta.demotes:
            assert lst.shape == (DEMOTES_PER_PAIR, 2)
            triton_demote.demote_pairs(layer, lst, s, d)
    for layer in pools[1].layers:  # the eager step's
        for s, d, pairs in runs:
            reference.demote_pairs(layer, torch.tensor(pairs), s, d)
    for a, b in zip(arena_bytes(launched), arena_bytes(pools[1])):
        assert torch.equal(a.cpu(), b)
    twice = HostStep(slots=[0], tables=[[0]], seq_lens=[1], num_new=[1],
                     demotes=((0, 1, [(0, 7)]), (1, 2, [(7, 9)])))  # block 0 -> tier 1 block 7 -> tier 2
    many = HostStep(slots=[0], tables=[[0]], seq_lens=[1], num_new=[1],
                    demotes=((0, 1, [(i, 100 + i) for i in range(DEMOTES_PER_PAIR + 1)]),))
    assert not graphs.serves(twice) and not graphs.serves(many)


def test_apply_ops_wipes_and_demotes_without_waiting_for_the_device(kv):
    """The cache ops the engine runs outside the staged step (the slab wipe before every other op of the
    step, demotions among swaps) build their index lists without a host sync (kvq.cache.step.host_ids:
    on CUDA a pinned, asynchronous copy).  ``torch.tensor(ids, device=cuda)`` copied from pageable memory
    and synchronized the stream, i.e. waited for the previous step's forward under asynchronous
    scheduling; on a GPU this runs in torch's sync debug mode "error", where such a copy raises.  Here and
    on the CPU: the wipe zeroes exactly its slabs in every layer and the demotion writes the reference's
    bytes."""
    from kvq.cache.block_types import BlockRef, DemoteOp, WipeOp
    from kvq.cache.step import apply_ops

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base, tiers = "fp8_e4m3", "int4_kivi"
    expect, pool = filled(base, tiers, kv), filled(base, tiers, kv, dev)
    d = ids_from(expect, 1, DEST)
    for layer in expect.layers:
        reference.demote_pairs(layer, torch.tensor([(0, d[0]), (2, d[1])]), 0, 1)
        layer.arena.view(SLABS, -1)[[1, 8]] = 0
    ops = [DemoteOp(0, 0, BlockRef("q", 0), BlockRef("q1", d[0])),
           DemoteOp(0, 2, BlockRef("q", 2), BlockRef("q1", d[1])), WipeOp((8, 1))]
    kernels = reference if dev.type == "cpu" else triton_demote
    if dev.type == "cuda":
        apply_ops(filled(base, tiers, kv, dev), kernels, ops)  # (Triton's first launch compiles)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        apply_ops(pool, kernels, ops)
    finally:
        if dev.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(arena_bytes(pool), arena_bytes(expect)):
        assert torch.equal(a.cpu(), b)
