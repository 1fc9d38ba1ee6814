"""HostKVPool: device blocks to host slots and back, byte for byte, for every format with a kernel.

Pools are filled with real K/V (tests/fixtures/kv_smollm2.pt: 4 layers of SmolLM2-135M,
3 KV heads, head_dim 64): hp blocks hold the bf16 tokens, q blocks those tokens sealed by
the reference quantizer, so every plane (data, scale, zero) holds what the cache holds.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvq.attention.reference import seal_blocks
from kvq.cache.host_pool import CopyHandle, HostKVPool
from kvq.cache.plan import bare_model, make_plan
from kvq.cache.pool import KVPool
from kvq.formats import fp8
from kvq.formats.registry import entries, resolve_kv

FIXTURE = Path(__file__).parent / "fixtures" / "kv_smollm2.pt"
KERNEL_FORMATS = [e.name for e in entries()
                  if not (resolve_kv(e.name).k.reference_only or resolve_kv(e.name).v.reference_only)]
#: (format, plan options): every format with its default windows, plus explicit windows on a
#: per-token format, a skipped (bf16) layer among quantized ones, and K and V in different formats.
CASES = [(f, {}) for f in KERNEL_FORMATS] + [
    ("fp8_per_token_head", {"sink_tokens": 4, "residual_tokens": 64}),
    ("int4_kivi", {"skip_layers": (1,)}),
    ("auto", {"k": "int4_kivi", "v": "int8"}),
]
NUM_Q, NUM_HP = 12, 8  # device pool
HOST_Q, HOST_HP = 10, 6


@pytest.fixture(scope="module")
def kv() -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.load(FIXTURE, weights_only=True)
    return data["k"], data["v"]  # [L=4, T=896, H=3, D=64] bf16


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return fp8.as_bytes(t).view(torch.uint8)


def filled_pool(fmt: str, opts: dict, kv, device="cpu") -> KVPool:
    k, v = kv
    L, T, H, D = k.shape
    plan = make_plan(bare_model(L, H, D), fmt, **opts)
    pool = KVPool.create(plan, NUM_Q, NUM_HP, device)
    bs = plan.block_size
    assert (NUM_Q + NUM_HP) * bs <= T

    def blocks(x: torch.Tensor, start: int, n: int) -> torch.Tensor:  # [T, H, D] -> [n, H, bs, D]
        return x[start * bs:(start + n) * bs].reshape(n, bs, H, D).transpose(1, 2).contiguous().to(device)

    for i, layer in enumerate(pool.layers):
        # q blocks: tokens [0, NUM_Q * bs) sealed through the reference quantizer
        scratch = replace(layer, k_hp=blocks(k[i], 0, NUM_Q), v_hp=blocks(v[i], 0, NUM_Q))
        ids = torch.arange(NUM_Q, device=device)
        seal_blocks(scratch, ids, ids)
        # hp blocks: the next NUM_HP blocks of tokens, in the model dtype
        layer.k_hp.copy_(blocks(k[i], NUM_Q, NUM_HP))
        layer.v_hp.copy_(blocks(v[i], NUM_Q, NUM_HP))
    return pool


def device_tensors(pool: KVPool) -> dict[str, torch.Tensor]:
    out = {}
    for i, layer in enumerate(pool.layers):
        for role in ("k", "v"):
            out |= {f"{i}.{role}.{name}": t for name, t in layer.planes(role).items()}
            out[f"{i}.{role}_hp"] = layer.hp(role)
    return out


def host_tensors(host: HostKVPool) -> dict[str, torch.Tensor]:
    out = {}
    for i, layer in enumerate(host.layers):
        for role in ("k", "v"):
            out |= {f"{i}.{role}.{name}": t for name, t in layer.planes(role).items()}
        out[f"{i}.k_hp"], out[f"{i}.v_hp"] = layer.k_hp, layer.v_hp
    return out


def snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: as_bytes(t).cpu().clone() for name, t in tensors.items()}


def check_rows(now: dict, expect: dict, rows: dict[str, dict[int, int]], nrows: dict[str, int], what: str) -> None:
    """``now[name][r]`` equals ``expect[name][rows[kind][r]]`` for moved rows ``r`` and
    ``expect[name][r]`` (untouched) for every other row, byte for byte."""
    for name, t in now.items():
        kind = "hp" if name.endswith("_hp") else "q"
        got = as_bytes(t).cpu()
        moved = rows[kind]
        assert got.shape[0] == nrows[kind]
        for r in range(nrows[kind]):
            src = moved.get(r, r)
            assert torch.equal(got[r], expect[name][src]), f"{what}: {name} row {r} (expected row {src})"


def pick(rng: random.Random, n_src: int, n_dst: int, k: int) -> list[tuple[int, int]]:
    return list(zip(rng.sample(range(n_src), k), rng.sample(range(n_dst), k)))


@pytest.mark.parametrize("fmt,opts", CASES, ids=[f"{f}-{'-'.join(map(str, o.values())) or 'default'}"
                                                  for f, o in CASES])
def test_store_scribble_load_roundtrip_is_byte_exact(fmt, opts, kv):
    pool = filled_pool(fmt, opts, kv)
    host = HostKVPool.create(pool, HOST_Q, HOST_HP)
    assert not host.pinned
    dev = device_tensors(pool)
    original = snapshot(dev)
    for name, b in original.items():  # the data is real: no plane is all zeros
        assert bool(b.any()), name
    host_before = snapshot(host_tensors(host))
    rng = random.Random(f"{fmt}{opts}")

    q_store, hp_store = pick(rng, NUM_Q, HOST_Q, 5), pick(rng, NUM_HP, HOST_HP, 3)
    h = host.store(pool, q_store, hp_store)
    assert isinstance(h, CopyHandle) and h.done() and (h.num_q_blocks, h.num_hp_blocks) == (5, 3)
    # host slots hold the device rows; other slots and the device pool are untouched
    stored_rows = {"q": {hs: d for d, hs in q_store}, "hp": {hs: d for d, hs in hp_store}}
    for name, t in host_tensors(host).items():
        kind = "hp" if name.endswith("_hp") else "q"
        got = as_bytes(t)
        for r in range(got.shape[0]):
            want = original[name][stored_rows[kind][r]] if r in stored_rows[kind] else host_before[name][r]
            assert torch.equal(got[r], want), f"store: host {name} slot {r}"
    check_rows(dev, original, {"q": {}, "hp": {}}, {"q": NUM_Q, "hp": NUM_HP}, "store left the device")
    host_after_store = snapshot(host_tensors(host))

    # scribble over the stored device blocks
    q_ids = torch.tensor([d for d, _ in q_store])
    hp_ids = torch.tensor([d for d, _ in hp_store])
    gen = torch.Generator().manual_seed(0)
    for name, t in dev.items():
        ids = hp_ids if name.endswith("_hp") else q_ids
        b = as_bytes(t)
        b[ids] = torch.randint(0, 256, b[ids].shape, dtype=torch.uint8, generator=gen)
    scribbled = snapshot(dev)

    # load into other device blocks (a rotation of the ids used, so none lands where it came from)
    def moved(pairs, n_dev):
        dsts = rng.sample([i for i in range(n_dev) if i not in {d for d, _ in pairs}], len(pairs))
        return [(hs, dst) for (_, hs), dst in zip(pairs, dsts)]

    q_load, hp_load = moved(q_store, NUM_Q), moved(hp_store, NUM_HP)
    h = host.load(pool, q_load, hp_load)
    assert h.done()
    host_slot_to_dev = {"q": {hs: d for d, hs in q_store}, "hp": {hs: d for d, hs in hp_store}}
    for name, t in dev.items():
        kind = "hp" if name.endswith("_hp") else "q"
        loads = {dst: host_slot_to_dev[kind][hs] for hs, dst in (q_load if kind == "q" else hp_load)}
        got = as_bytes(t)
        for r in range(got.shape[0]):
            want = original[name][loads[r]] if r in loads else scribbled[name][r]
            assert torch.equal(got[r], want), f"load: device {name} block {r}"
    check_rows(host_tensors(host), host_after_store, {"q": {}, "hp": {}}, {"q": HOST_Q, "hp": HOST_HP},
               "load left the host")


@pytest.mark.parametrize("fmt,opts", [("int4_kivi", {}), ("fp8_per_block", {}), ("bfloat16", {}),
                                      ("int4_kivi", {"skip_layers": (0, 3)})])
def test_bytes_per_block_are_the_planes_and_the_plans(fmt, opts, kv):
    pool = filled_pool(fmt, opts, kv)
    host = HostKVPool.create(pool, HOST_Q, HOST_HP)
    plan, m = pool.plan, pool.plan.model
    H, D, bs = m.num_kv_heads, m.head_dim, plan.block_size
    planes = sum(p.nbytes for f in plan.layers for tf in (f.k, f.v) for p in tf.planes(H, D, bs))
    assert host.bytes_per_q_block == planes == plan.bytes_per_block
    assert host.bytes_per_hp_block == 2 * m.num_layers * H * bs * D * 2 == plan.hp_bytes_per_block  # bf16
    assert host.capacity_bytes == HOST_Q * plan.bytes_per_block + HOST_HP * plan.hp_bytes_per_block
    assert host.nbytes() == host.capacity_bytes
    host_empty = HostKVPool.create(pool, 0, 0)
    assert host_empty.capacity_bytes == 0 and host_empty.bytes_per_q_block == host.bytes_per_q_block
    assert host_empty.store(pool).done()


def test_budget_to_block_counts(kv):
    kivi = make_plan(bare_model(4, 3, 64), "int4_kivi")
    bq, bhp = kivi.bytes_per_block, kivi.hp_bytes_per_block
    q_per, hp_per = kivi.blocks_for(4096)
    assert hp_per > 0
    per_seq = q_per * bq + hp_per * bhp
    for budget in (per_seq * 3 + bq * 2 + 5, per_seq - 1, hp_per * bhp, 10 * 2**20):
        q, hp = HostKVPool.blocks_for_budget(kivi, budget, context_len=4096)
        assert q * bq + hp * bhp <= budget < q * bq + hp * bhp + bq, budget  # nothing left that a block fits
        assert hp >= hp_per * max(1, budget // per_seq) or hp == budget // bhp
    assert HostKVPool.blocks_for_budget(kivi, per_seq * 3, context_len=4096) == (3 * q_per, 3 * hp_per)
    assert HostKVPool.blocks_for_budget(kivi, 0) == (0, 0)
    bf16 = make_plan(bare_model(4, 3, 64), "bfloat16")
    assert HostKVPool.blocks_for_budget(bf16, 10 * bf16.bytes_per_block + 1) == (10, 0)  # no windows: no hp
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="budget"):
            HostKVPool.blocks_for_budget(kivi, bad)
    pool = KVPool.create(kivi, 2, 2)
    host = HostKVPool.from_budget(pool, per_seq * 2, context_len=4096)
    assert (host.num_q_blocks, host.num_hp_blocks) == (2 * q_per, 2 * hp_per)
    assert host.capacity_bytes == per_seq * 2


def test_bad_arguments_raise_naming_the_problem(kv):
    pool = filled_pool("int8", {}, kv)
    host = HostKVPool.create(pool, 4, 2)
    cases = [
        (lambda: host.store(pool, [(NUM_Q, 0)]), r"q_pairs: device q block 12 out of range 0\.\.11"),
        (lambda: host.store(pool, [(0, 4)]), r"q_pairs: host q block 4 out of range 0\.\.3"),
        (lambda: host.store(pool, [], [(-1, 0)]), r"hp_pairs: device hp block -1 out of range"),
        (lambda: host.load(pool, [], [(2, 0)]), r"hp_pairs: host hp block 2 out of range 0\.\.1"),
        (lambda: host.load(pool, [(0, NUM_Q)]), r"q_pairs: device q block 12 out of range"),
        (lambda: host.store(pool, [(0, 1, 2)]), r"q_pairs\[0\].*length 2, got length 3"),
        (lambda: host.store(pool, [(0,)]), r"q_pairs\[0\].*length 2, got length 1"),
        (lambda: host.store(pool, [5]), r"q_pairs\[0\].*length 2"),
        (lambda: host.store(pool, torch.zeros(3, 3, dtype=torch.int64)), r"q_pairs: expected an \[N, 2\] tensor"),
        (lambda: host.store(pool, [(0.0, 1)]), r"q_pairs\[0\].*ints"),
        (lambda: host.store(pool, [(True, 1)]), r"q_pairs\[0\].*ints"),
        (lambda: host.store(pool, [(0, 1), (2, 1)]), r"q_pairs: host q block 1 is written twice"),
        (lambda: HostKVPool.create(pool, -1, 0), r"num_q_blocks must be an int >= 0"),
        (lambda: HostKVPool.create(pool, 1, 0, pin=True), r"pin=True needs a CUDA pool"),
        (lambda: host.store(KVPool.create(make_plan(bare_model(4, 3, 64), "int4_kivi"), NUM_Q, NUM_HP), [(0, 0)]),
         r"mirrors a pool of plan int8"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    # a tensor of pairs and numpy-style integer ids are accepted; nothing above copied anything
    assert not any(bool(as_bytes(t).any()) for t in host_tensors(host).values())
    assert host.store(pool, torch.tensor([[3, 0]]), [(torch.tensor(1), 1)]).done()
    assert torch.equal(as_bytes(host.layers[0].k["data"][0]), as_bytes(pool.layers[0].k["data"][3]))
    assert torch.equal(as_bytes(host.layers[2].v_hp[1]), as_bytes(pool.layers[2].v_hp[1]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copies_run_on_a_copy_stream_after_queued_work(kv):
    pool = filled_pool("int4_kivi", {}, kv, device="cuda")
    host = HostKVPool.create(pool, HOST_Q, HOST_HP)
    assert host.pinned
    layer = pool.layers[0]
    # queue a long kernel, then a write to q block 3 behind it: the store must copy the new bytes
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles on the current stream
    as_bytes(layer.k["data"])[3].fill_(0x5A)
    h = host.store(pool, [(3, 7)], [(2, 5)])
    assert not h.done()  # the copy stream waits behind the sleep; no host sync happened
    h.synchronize()
    assert h.done() and not h.keep
    assert bool((as_bytes(host.layers[0].k["data"][7]) == 0x5A).all())
    assert torch.equal(as_bytes(host.layers[3].v_hp[5]), as_bytes(pool.layers[3].v_hp[2]).cpu())
    # load into other blocks; the current stream waits on the handle's event before reading them
    expect = {n: as_bytes(t).cpu().clone() for n, t in device_tensors(pool).items()}
    torch.cuda._sleep(200_000_000)
    h = host.load(pool, [(7, 9)], [(5, 0)])
    assert not h.done()
    h.wait()
    got = {n: as_bytes(t).clone() for n, t in device_tensors(pool).items()}  # queued after the wait
    torch.cuda.synchronize()
    for name, t in got.items():
        kind_row = (0, 2) if name.endswith("_hp") else (9, 3)
        exp = expect[name].clone()
        exp[kind_row[0]] = expect[name][kind_row[1]]
        assert torch.equal(t.cpu(), exp), name
    # unpinned host memory on CUDA: the same copies, synchronous
    plain = HostKVPool.create(pool, 2, 2, pin=False)
    assert not plain.pinned and plain.store(pool, [(9, 1)], [(0, 0)]).done()
    assert torch.equal(as_bytes(plain.layers[1].v["scale"][1]), as_bytes(pool.layers[1].v["scale"][9]).cpu())


@pytest.mark.parametrize("ladder", [("fp8_e4m3", "int4_kivi"), ("bfloat16", "fp8_e4m3,int4_kivi,int2_kivi")])
def test_a_tiered_pools_blocks_round_trip_in_their_own_format(ladder):
    """Elastic precision: a host q block holds a block of any tier (its row of bytes viewed as that tier's
    planes); each tier's device blocks go out and come back into other blocks byte for byte, in every
    layer (layers after the first sit at an offset inside the host memory), and a bad tier is refused."""
    plan = make_plan(bare_model(3, 2, 64), ladder[0], tiers=ladder[1], sink_tokens=32, residual_tokens=32)
    pool = KVPool.create(plan, 0, 3, "cpu", num_slabs=8)  # tier t's blocks in slabs 2t (out) and 2t + 1 (in)
    per = pool.layout.per_slab

    def ids(t: int, slab: int) -> list[int]:
        return [slab * per[t], slab * per[t] + per[t] - 1]
    g = torch.Generator().manual_seed(5)
    for layer in pool.layers:
        layer.arena.copy_(torch.randint(0, 256, layer.arena.shape, generator=g, dtype=torch.uint8))
        for t in (layer.k_hp, layer.v_hp):
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    host = HostKVPool.create(pool, 9, 3)
    tiers = [f"q{t}" for t in range(1, plan.num_tiers + 1)]

    def blocks(name, ids):
        t = None if name == "hp" else (0 if name == "q" else int(name[1:]))
        out = []
        for layer in pool.layers:
            lt = layer if t is None else layer.tier(t)
            xs = [lt.k_hp, lt.v_hp] if t is None else [*lt.k.values(), *lt.v.values()]
            out.append([fp8.as_bytes(x[i]).contiguous().view(torch.uint8).clone() for x in xs for i in ids])
        return out

    before = {"q": blocks("q", ids(0, 0)), "hp": blocks("hp", [0, 1]),
              **{n: blocks(n, ids(t, 2 * t)) for t, n in enumerate(tiers, 1)}}
    q_pairs = list(zip(ids(0, 0), [0, 1]))
    tier_pairs = [(n, list(zip(ids(t, 2 * t), [2 * t, 2 * t + 1]))) for t, n in enumerate(tiers, 1)]
    host.store(pool, q_pairs, [(0, 0), (1, 1)], tier_pairs).synchronize()
    for layer in pool.layers:
        layer.arena.zero_()
        layer.k_hp.zero_()
        layer.v_hp.zero_()
    host.load(pool, list(zip([0, 1], ids(0, 1))), [(0, 1), (1, 2)],
              [(n, list(zip([h for _, h in pairs], ids(t, 2 * t + 1)))) for t, (n, pairs) in
               enumerate(tier_pairs, 1)]).synchronize()
    after = {"q": blocks("q", ids(0, 1)), "hp": blocks("hp", [1, 2]),
             **{n: blocks(n, ids(t, 2 * t + 1)) for t, n in enumerate(tiers, 1)}}
    for name in before:
        for la, lb in zip(before[name], after[name]):
            assert all(torch.equal(a, b) for a, b in zip(la, lb)), name
    with pytest.raises(ValueError, match="named twice"):
        host.store(pool, [(0, 0)], (), [(tiers[0], [(1, 0)])])
    with pytest.raises(ValueError, match="lower tiers"):
        host.store(pool, (), (), [(f"q{plan.num_tiers + 1}", [(0, 1)])])
    untiered = HostKVPool.create(KVPool.create(make_plan(bare_model(3, 2, 64), ladder[0]), 4, 3, "cpu"), 2, 2)
    with pytest.raises(ValueError, match="untiered"):
        untiered.store(untiered_pool := KVPool.create(untiered.plan, 4, 3, "cpu"), (), (), [("q1", [(0, 0)])])
    del untiered_pool
