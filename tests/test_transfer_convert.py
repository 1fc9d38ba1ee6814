"""Sender-cast bytes equal the receiver's own cache-write bytes, bit for bit, sidecars included.

K/V are real (tests/fixtures/kv_smollm2.pt: 4 layers of SmolLM2-135M, 896 tokens, 3 KV heads,
head_dim 64, bf16; layer 0 has K's outlier channels).  For every registered format, with its
default windows and with explicit ones (sinks, residual windows, windows longer than the
sequence, no window), mixed K/V formats, a skipped layer and static FP8 scales:

(a) the tokens are written into a bf16 sender pool (block size 16) through the engine's write
    path, and :class:`SenderCast` casts the sender's table into the receiver's plan;
(b) the same tokens are written into a receiver pool through the receiver's own path: its
    block manager's tables, ``write_kv`` of each step's slots, and the seal ops the manager
    returns run before the step's write (:func:`kvq.cache.step.apply_ops`), either as one
    prompt or as block-aligned prefill chunks then one decode token at a time, settled at
    the last length (the lazy seals the next step would run);

and every plane (data, scale, zero) of every q block and every hp block of every logical
block is compared as bytes.  One-shot writes land in fresh pools, so whole blocks (zero tails
included) and, after :meth:`StagedKV.install`, whole pools are compared; chunked writes may
reuse freed blocks, so there the tokens past ``n`` of a last partial block are not compared.

A quantized sender cannot give back what it rounded away, so there the reference is "the
sender's values as its attention reads them (dequantized to bf16), then the receiver's own
write"; where the sender's q block is already in the receiver's format its bytes pass through.

On a GPU machine the same file casts on CUDA, through the torch reference and through the
Triton write kernels, for every case and length, against the CPU reference's bytes
(``python -m pytest tests/test_transfer_convert.py``; on the H200: 58 passed in 36 s).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvq.attention import reference
from kvq.cache.block_manager import BlockManager, SealOp
from kvq.cache.plan import bare_model, make_plan
from kvq.cache.pool import KVPool, encode_slots, encode_table
from kvq.cache.step import apply_ops
from kvq.cache.window import block_state, can_seal
from kvq.formats.registry import entries
from kvq.transfer.convert import SenderCast, StagedKV, check_geometry, receiver_table

FIXTURE = Path(__file__).parent / "fixtures" / "kv_smollm2.pt"
MODEL = bare_model(4, 3, 64)
SENDER = make_plan(MODEL, "bfloat16")  # block size 16, everything in one dense pool
LENGTHS = (1, 17, 223, 333, 896)  # one token, mid-block, one token before a seal, whole blocks
#: (receiver format, plan options): every registered format with its defaults, then windows,
#: groups, block sizes, a skipped layer and K and V in different formats.
CASES = [(e.name, {}) for e in entries()] + [
    ("int8", {"sink_tokens": 16, "residual_tokens": 32}),
    ("fp8_per_token_head", {"sink_tokens": 4, "residual_tokens": 64}),
    ("fp8_per_block", {"sink_tokens": 20, "residual_tokens": 40}),
    ("fp8_e4m3", {"sink_tokens": 16}),
    ("int4_per_token", {"sink_tokens": 0, "residual_tokens": 0}),
    ("int4_kivi", {"sink_tokens": 0, "residual_tokens": 0}),
    ("int2_kivi", {"residual_tokens": 4096}),  # the window covers every sequence
    ("int4_kivi", {"block_size": 64, "group_size": 16}),
    ("int4_kivi", {"skip_layers": (1,)}),
    ("auto", {"k": "int4_kivi", "v": "int8"}),
    ("auto", {"k": "fp8_per_block", "v": "int2_kivi", "sink_tokens": 8, "residual_tokens": 48}),
    ("auto", {"k": "int8_per_token_head", "v": "fp8_e5m2", "residual_tokens": 16}),
]
STATIC = {i: (torch.tensor([0.5, 2.0, 0.25]), torch.tensor([1.5, 0.75, 4.0])) for i in range(4)}


def case_id(case) -> str:
    name, opts = case
    return name + "".join(f"-{k}={v}" for k, v in opts.items())


@pytest.fixture(scope="module")
def kv() -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.load(FIXTURE, weights_only=True)
    return data["k"], data["v"]  # [L=4, T=896, H=3, D=64] bf16


# -- the engine's own write path ---------------------------------------------------------------
def engine_fill(plan, k, v, n, *, chunk=None, prefill=None, static_scales=None, seals=None, device="cpu"):
    """Write tokens [0, n) of ``k``, ``v`` [L, >= n, H, D] as the engine does -> (pool, table).

    ``chunk=None``: one prompt of ``n`` tokens.  Else: the first ``prefill`` tokens in prompt
    chunks of ``chunk`` (block-aligned), then one decode token per step, then a step with no
    token that settles every block at length ``n`` (its seals are what the next step runs)."""
    bs = plan.block_size
    nb = -(-n // bs)
    bm = BlockManager(nb + 2, nb + 2, plan.window_policy, enable_prefix_caching=False)
    pool = KVPool.create(plan, nb + 2, nb + 2, device, static_scales)
    tokens = list(range(n))

    def write(a, b, ops=()):
        apply_ops(pool, reference, ops)  # seals and copies before the step's write
        if seals is not None:
            seals.extend(op for op in ops if isinstance(op, SealOp))
        if a == b:
            return
        slots = torch.tensor(encode_slots(bm.slots(0, a, b), bs), dtype=torch.int64, device=device)
        for i, layer in enumerate(pool.layers):
            reference.write_kv(layer, k[i, a:b].to(device), v[i, a:b].to(device), slots)

    if chunk is None:
        bm.allocate_prompt(0, tokens)
        write(0, n)
    else:
        assert chunk % bs == 0 and 0 < prefill <= n
        first = min(chunk, prefill)
        bm.allocate_prompt(0, tokens[:prefill], end=lambda hit: first)
        write(0, first)
        pos = first
        while pos < n:
            step = min(chunk, prefill - pos) if pos < prefill else 1
            write(pos, pos + step, bm.append_slots(0, tokens[pos:pos + step]))
            pos += step
        write(n, n, bm.append_slots(0, []))
    bm.check_integrity()
    table = bm.block_table(0)
    assert [r.pool for r in table] == [block_state(i, n, plan.window_policy) for i in range(nb)]
    return pool, table


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_blocks_equal(staged: StagedKV, pool: KVPool, table, n: int, tails: bool) -> None:
    """Every plane of every logical block: staged block ``staged.table[i]`` vs ``table[i]``."""
    assert [r.pool for r in staged.table] == [r.pool for r in table]
    bs = pool.plan.block_size
    for li, (a, b) in enumerate(zip(staged.pool.layers, pool.layers)):
        for role in ("k", "v"):
            fmt = a.tensor_format(role)
            for i, (s, r) in enumerate(zip(staged.table, table)):
                rows = bs if tails else min(bs, n - i * bs)
                if s.pool == "q":
                    assert rows == bs or fmt.write_direct
                    for name, t in a.planes(role).items():
                        x, y = t[s.block_id], b.planes(role)[name][r.block_id]
                        if rows < bs:
                            x, y = x[:, :rows], y[:, :rows]
                        assert torch.equal(as_bytes(x), as_bytes(y)), f"layer {li} {role} {name} block {i} n={n}"
                else:
                    x, y = a.hp(role)[s.block_id, :, :rows], b.hp(role)[r.block_id, :, :rows]
                    assert torch.equal(as_bytes(x), as_bytes(y)), f"layer {li} {role}_hp block {i} n={n}"


def assert_pools_equal(x: KVPool, y: KVPool) -> None:
    for a, b in zip(x.layers, y.layers):
        for s, t in zip(a.tensors(), b.tensors()):
            assert torch.equal(as_bytes(s), as_bytes(t))


def bf16_sender(kv, n):
    return engine_fill(SENDER, *kv, n)


# -- the test: a bf16 sender, every receiver format --------------------------------------
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cast_equals_receiver_write(kv, case):
    name, opts = case
    plan = make_plan(MODEL, name, **opts)
    cast = SenderCast(plan)
    for n in LENGTHS:
        src, src_table = bf16_sender(kv, n)
        staged = cast.cast(src, src_table, n)
        assert (staged.pool.num_q_blocks, staged.pool.num_hp_blocks) == plan.blocks_for(n)
        assert staged.passthrough == ()
        ref, table = engine_fill(plan, *kv, n)
        assert_blocks_equal(staged, ref, table, n, tails=True)
        # the receiver stores the bytes as they arrive: its pool then equals its own write, whole
        recv = KVPool.create(plan, ref.num_q_blocks, ref.num_hp_blocks)
        staged.install(recv, table)
        assert_pools_equal(recv, ref)


@pytest.mark.parametrize("case", [c for c in CASES if c[1] or c[0] in ("int8", "fp8_per_block", "int2_kivi",
                                                                       "int4_per_token", "fp8_e4m3")],
                         ids=case_id)
def test_cast_equals_chunked_write_with_seals(kv, case):
    """The receiver's blocks written by prefill chunks and decode steps, sealed lazily."""
    name, opts = case
    plan = make_plan(MODEL, name, **opts)
    sealed = []
    for n, prefill in ((333, 192), (200, 64)):
        src, src_table = bf16_sender(kv, n)
        staged = SenderCast(plan).cast(src, src_table, n)
        ref, table = engine_fill(plan, *kv, n, chunk=64, prefill=prefill, seals=sealed)
        assert_blocks_equal(staged, ref, table, n, tails=False)
    # sealed blocks were compared too (wherever a block leaves the window)
    assert bool(sealed) == (can_seal(plan.window_policy) and plan.blocks_for(333)[0] > 0)


def test_static_scales(kv):
    plan = make_plan(MODEL, "fp8_e4m3", sink_tokens=16)
    for n in (17, 333):
        src, src_table = bf16_sender(kv, n)
        staged = SenderCast(plan, static_scales=STATIC).cast(src, src_table, n)
        ref, table = engine_fill(plan, *kv, n, static_scales=STATIC)
        assert_blocks_equal(staged, ref, table, n, tails=True)
        plain = SenderCast(plan).cast(src, src_table, n)  # the scales are used: other bytes
        assert not torch.equal(as_bytes(plain.pool.layers[0].k["data"]), as_bytes(staged.pool.layers[0].k["data"]))


def test_sender_table_chunked_and_other_block_size(kv):
    """A sender whose table is mid-way (lazy seals pending) and whose blocks are 64 tokens."""
    sender = make_plan(MODEL, "bfloat16", block_size=64)
    plan = make_plan(MODEL, "int4_kivi")  # block size 32
    n = 300
    src, src_table = engine_fill(sender, *kv, n, chunk=128, prefill=256)
    staged = SenderCast(plan).cast(src, src_table, n)
    ref, table = engine_fill(plan, *kv, n)
    assert_blocks_equal(staged, ref, table, n, tails=True)


# -- quantized senders: dequantize, then the receiver's write (or the sender's bytes) ---------
def dequantized(pool: KVPool, table, n) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, n, H, D] bf16 K and V as the sender's attention reads them."""
    ids = torch.tensor(encode_table(table), dtype=torch.int64)
    out = [torch.stack([reference.gather_kv(layer, role, ids, n, torch.bfloat16).transpose(0, 1)
                        for layer in pool.layers]) for role in ("k", "v")]
    return out[0], out[1]


@pytest.mark.parametrize("sender_fmt, receiver", [
    ("int8", ("fp8_e4m3", {})),
    ("int4_kivi", ("fp8_per_block", {"sink_tokens": 16, "residual_tokens": 32})),
    ("fp8_per_block", ("int2_kivi", {})),
    ("int8", ("int8_per_token_head", {"sink_tokens": 16})),  # same family, other scale dtype: no passthrough
], ids=lambda x: x if isinstance(x, str) else case_id(x))
def test_quantized_sender(kv, sender_fmt, receiver):
    sender = make_plan(MODEL, sender_fmt)
    plan = make_plan(MODEL, receiver[0], **receiver[1])
    for n in (1, 17, 333):
        src, src_table = engine_fill(sender, *kv, n)
        staged = SenderCast(plan).cast(src, src_table, n)
        assert staged.passthrough == ()
        ref, table = engine_fill(plan, *dequantized(src, src_table, n), n)
        assert_blocks_equal(staged, ref, table, n, tails=True)


@pytest.mark.parametrize("fmt, receiver_opts", [
    ("int8", {}),  # a partly filled last q block: its tokens pass, the tail stays zero
    ("int8", {"sink_tokens": 16, "residual_tokens": 32}),
    ("int4_kivi", {}),
    ("int4_kivi", {"sink_tokens": 64, "residual_tokens": 32}),
    ("fp8_per_block", {}),
])
def test_same_format_passes_bytes_through(kv, fmt, receiver_opts):
    """q blocks in the receiver's format are the sender's bytes; the rest as above."""
    sender = make_plan(MODEL, fmt)
    plan = make_plan(MODEL, fmt, **receiver_opts)
    for n in (17, 333, 896):
        src, src_table = engine_fill(sender, *kv, n)
        staged = SenderCast(plan).cast(src, src_table, n)
        assert set(staged.passthrough) == {(i, r) for i in range(4) for r in ("k", "v")}
        ref, table = engine_fill(plan, *dequantized(src, src_table, n), n)
        for li, (a, b, c) in enumerate(zip(staged.pool.layers, ref.layers, src.layers)):
            for role in ("k", "v"):
                for i, s in enumerate(staged.table):
                    if s.pool == "q" and src_table[i].pool == "q":  # the sender's bytes
                        want = {name: t[src_table[i].block_id] for name, t in c.planes(role).items()}
                    elif s.pool == "q":  # from the sender's hp block: the receiver's write
                        want = {name: t[table[i].block_id] for name, t in b.planes(role).items()}
                    else:
                        want = {"hp": b.hp(role)[table[i].block_id]}
                    got = a.planes(role) if s.pool == "q" else {"hp": a.hp(role)}
                    for name, w in want.items():
                        assert torch.equal(as_bytes(got[name][s.block_id]), as_bytes(w)), (li, role, name, i, n)
        if plan == sender:  # same plan, settled table: the staged blocks are the sender's blocks
            assert_blocks_equal(staged, src, src_table, n, tails=True)


# -- layout and errors -----------------------------------------------------------------------------
def test_receiver_table_follows_the_window_rule():
    plan = make_plan(MODEL, "int4_kivi", sink_tokens=4, residual_tokens=64)  # bs 32: 1 sink block
    t = receiver_table(plan, 200)  # 7 blocks; q iff (i + 1) * 32 <= 136
    assert [r.pool for r in t] == ["hp", "q", "q", "q", "hp", "hp", "hp"]
    assert [r.block_id for r in t] == [0, 0, 1, 2, 1, 2, 3]
    with pytest.raises(ValueError, match="at least one token"):
        receiver_table(plan, 0)


def test_geometry_mismatch_names_the_field(kv):
    src, table = bf16_sender(kv, 17)
    for other, field in ((bare_model(4, 3, 32), "head_dim"), (bare_model(4, 1, 64), "num_kv_heads"),
                         (bare_model(3, 3, 64), "num_layers"), (bare_model(4, 3, 64, dtype="float16"), "dtype")):
        with pytest.raises(ValueError, match=field):
            SenderCast(make_plan(other, "int8")).cast(src, table, 17)
        with pytest.raises(ValueError, match=field):
            check_geometry(SENDER, make_plan(other, "int8"))
    with pytest.raises(ValueError, match="sender blocks"):
        SenderCast(make_plan(MODEL, "int8")).cast(src, table, 40)
    staged = SenderCast(make_plan(MODEL, "int8")).cast(src, table, 17)
    with pytest.raises(ValueError, match="plan"):
        staged.install(KVPool.create(make_plan(MODEL, "fp8_e4m3"), 4, 4), [])


# -- on the device, with the backend's own write kernels -------------------------------------------
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cast_on_device_with_backend_kernels(kv, backend):
    """The cast on the pool's device (CUDA where there is one; Triton under its interpreter on
    the CPU), through the backend's write kernels, gives the CPU reference's bytes."""
    from kvq.attention.backends import get_backend

    if backend == "triton":
        pytest.importorskip("triton")
    lengths = LENGTHS if DEV == "cuda" else (33,)
    cases = CASES if DEV == "cuda" else [("int8", {}), ("fp8_per_block", {"residual_tokens": 16}),
                                         ("auto", {"k": "int4_kivi", "v": "int2_kivi", "residual_tokens": 0})]
    ran = 0
    for name, opts in cases:
        plan = make_plan(MODEL, name, **opts)
        be = get_backend(backend)
        if be.unsupported_reason(plan, DEV, torch.bfloat16) is not None:
            continue
        cast = SenderCast(plan, kernels=be.kernels())
        for n in lengths:
            src, src_table = engine_fill(SENDER, *kv, n, device=DEV)
            staged = cast.cast(src, src_table, n)
            assert staged.pool.device.type == DEV
            ref, table = engine_fill(plan, *kv, n)
            staged.pool = _to_cpu(staged.pool, plan)
            assert_blocks_equal(staged, ref, table, n, tails=True)
            ran += 1
    assert ran


def _to_cpu(pool: KVPool, plan) -> KVPool:
    out = KVPool.create(plan, pool.num_q_blocks, pool.num_hp_blocks)
    for a, b in zip(pool.layers, out.layers):
        for s, t in zip(a.tensors(), b.tensors()):
            as_bytes(t).copy_(as_bytes(s).cpu())  # contiguous: views of the pool's own tensors
    return out


# -- a sender with elastic precision: blocks of its table in several formats ----------------------
def tiered_fill(plan, k, v, n, chunk=64):
    """Tokens [0, n) written by a tiered engine: prompt chunks of ``chunk`` then decode tokens, each
    append ageing the blocks behind it into the lower tier (the age policy), demotions and seals run
    before each step's write -> (pool, table with lower-tier blocks)."""
    from kvq.cache.arena import arena_layout

    bs, lay = plan.block_size, arena_layout(plan)
    nb = -(-n // bs)
    slabs = 2 * nb + 4
    bm = BlockManager(0, nb + 2, plan.window_policy, enable_prefix_caching=False, tiers=plan.tier_rule,
                      arena=(lay.per_slab, slabs, 0))
    pool = KVPool.create(plan, 0, nb + 2, num_slabs=slabs)

    def write(a, b, ops=()):
        apply_ops(pool, reference, ops)
        if a < b:
            slots = torch.tensor(encode_slots(bm.slots(0, a, b), bs), dtype=torch.int64)
            for i, layer in enumerate(pool.layers):
                reference.write_kv(layer, k[i, a:b], v[i, a:b], slots)

    tokens = list(range(n))
    first = min(chunk, n)
    bm.allocate_prompt(0, tokens, end=lambda hit: first)
    write(0, first)
    pos = first
    while pos < n:
        step = min(chunk, n - pos) if pos < n // 2 else 1
        bm.begin_step()
        ops = bm.append_slots(0, tokens[pos:pos + step])
        bm.mark_computed(0, pos)
        write(pos, pos + step, ops)
        pos += step
    bm.mark_computed(0, n)
    bm.check_integrity()
    return pool, bm.block_table(0)


@pytest.mark.parametrize("receiver", [("fp8_e4m3", {"residual_tokens": 32}), ("int8", {}),
                                      ("int4_kivi", {"residual_tokens": 32})], ids=lambda r: r[0])
def test_tiered_sender_casts_every_tier_as_its_attention_reads_it(kv, receiver):
    """A prefill server whose blocks aged into int4_kivi (fp8_e4m3 > int4_kivi, age policy) sends what
    its attention reads: demoted blocks dequantized through their tier, then the receiver's own write;
    resident fp8_e4m3 blocks pass through as bytes where the receiver keeps fp8_e4m3."""
    sender = make_plan(MODEL, "fp8_e4m3", residual_tokens=32, tiers=("int4_kivi",), tier_age=96)
    plan = make_plan(MODEL, receiver[0], block_size=sender.block_size, **receiver[1])
    for n in (223, 333):
        src, src_table = tiered_fill(sender, *kv, n)
        assert any(r.pool == "q1" for r in src_table), [r.pool for r in src_table]
        staged = SenderCast(plan).cast(src, src_table, n)
        ref, table = engine_fill(plan, *dequantized(src, src_table, n), n)
        if receiver[0] == "fp8_e4m3":
            assert staged.passthrough  # tier-0 blocks are the sender's bytes ...
            for li, (a, c) in enumerate(zip(staged.pool.layers, src.layers)):
                for i, (s, r) in enumerate(zip(staged.table, src_table)):
                    if s.pool == "q" and r.pool == "q":
                        for name, t in c.planes("k").items():
                            assert torch.equal(as_bytes(a.planes("k")[name][s.block_id]), as_bytes(t[r.block_id]))
            # ... and everything else, the demoted blocks included, the receiver's write of the read values
            q1 = [i for i, r in enumerate(src_table) if r.pool == "q1"]
            for li, (a, b) in enumerate(zip(staged.pool.layers, ref.layers)):
                for i in q1:
                    s, t = staged.table[i], table[i]
                    if s.pool == "q":
                        for name, x in a.planes("v").items():
                            assert torch.equal(as_bytes(x[s.block_id]), as_bytes(b.planes("v")[name][t.block_id]))
        else:
            assert staged.passthrough == ()
            assert_blocks_equal(staged, ref, table, n, tails=True)
