"""Sender-side cast: one sequence's KV, as the receiver's cache would hold it.

Prefill and decode servers may keep different resident KV formats (seed 000: a
bf16 prefill side, an FP8 or KIVI decode side), and even different windows and
block sizes.  The KV crosses already in the *receiver's* format, so the
receiver stores the bytes as they arrive.  :class:`SenderCast` does the cast on
the sender, on the sender's device, with the receiver's own write path::

    sender pool (its plan, its table)             staging pool (receiver's plan)
    block 0 hp ----+                              hp 0   <- logical 0   (sink)
    block 1 q  ----+-> [n, H, D] model dtype  --> q  0   <- logical 1
    block 2 q  ----+   per layer, K and V         q  1   <- logical 2
    block 3 hp ----+   (read as the sender's      hp 1   <- logical 3   (recent window)
                        attention reads it)

1. Read: the sender's first ``n`` tokens of every layer, K and V, in the model
   dtype: hp blocks as stored, q blocks dequantized by the reference
   (:func:`kvq.attention.reference.gather_kv`, the values the sender's own
   attention reads).  Block sizes may differ: everything goes through tokens.
2. Lay out: logical block ``i`` of the receiver goes to pool
   ``block_state(i, n, receiver policy)``, the table the receiver's block
   manager gives a prompt of ``n`` tokens (:meth:`BlockManager.allocate_prompt`);
   q blocks get staging ids ``0..k-1`` and hp blocks ``0..m-1``, in logical order.
3. Write: the receiver's ``write_kv`` (reference by default, or the backend's
   kernels) stores the tokens into the staging pool at those slots: hp blocks in
   the model dtype; q blocks quantized per token (``write_direct`` formats) or,
   for block-scoped scales (per-block FP8, KIVI K's per-channel groups), as
   whole blocks, i.e. the sealed block.  Sidecars (scales, zero points) land in
   their planes with the data.
4. Pass through: where the sender's block is q in exactly the receiver's
   format (same :class:`TensorFormat`, block size and static scale) and the
   receiver wants it q, its bytes are copied instead: re-quantizing dequantized
   values could move codes (double rounding), and the sender's bytes are the
   best the receiver can get.

Why bit-exact.  The receiver's write casts new K/V to the model dtype and then
quantizes with :func:`kvq.formats.reference.quantize`; a seal quantizes the hp
block holding the same model-dtype values with the same function.  Every scale
comes from max/min/absmax reductions (exact, independent of order and of how
many tokens are quantized together) and elementwise IEEE float32 ops, and
per-token scales see one token at a time.  So a block's bytes depend only on its
model-dtype values and the pool it is in: not on whether it was written in one
prompt, in chunks, token by token and sealed later, nor on which machine ran the
write.  For a bf16 (or any hp) sender the values the cast starts from are the
very values the receiver would have written, hence the same bytes, sidecars
included.  For a quantized sender the receiver gets what it would write from
the sender's dequantized values (or the sender's bytes, step 4); values a
quantized sender lost cannot be recovered, so a receiver hp block (its sinks,
its recent window) holds the dequantized values, not the original ones.

Tails past ``n`` in the last block are left as a fresh pool holds them (zeros),
as in the receiver's own freshly allocated blocks.  Host metadata (the tables)
is built here; tensors live on the sender pool's device, so the same code runs
on the CPU and on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvq.attention import reference
from kvq.cache.block_manager import BlockRef
from kvq.cache.plan import CachePlan
from kvq.cache.pool import KVPool, LayerKV, encode_table
from kvq.cache.window import POOLS, block_state
from kvq.formats import fp8

ROLES = ("k", "v")


def receiver_table(plan: CachePlan, n: int) -> tuple[BlockRef, ...]:
    """Logical block ``i`` of ``n`` tokens -> (its pool under the receiver's window rule,
    its staging id: q and hp blocks each numbered from 0 in logical order)."""
    if n < 1:
        raise ValueError(f"a transfer needs at least one token, got {n}")
    policy, count = plan.window_policy, {"q": 0, "hp": 0}
    out = []
    for i in range(-(-n // plan.block_size)):
        pool = block_state(i, n, policy)
        out.append(BlockRef(pool, count[pool]))
        count[pool] += 1
    return tuple(out)


def check_geometry(sender: CachePlan, receiver: CachePlan) -> None:
    """Raise ValueError naming the first field in which the two plans' models differ
    (formats, windows and block sizes may differ; the tokens' shape may not)."""
    a, b = sender.model, receiver.model
    for name in ("num_layers", "num_kv_heads", "head_dim", "dtype"):
        if getattr(a, name) != getattr(b, name):
            raise ValueError(f"KV geometry mismatch: sender {name}={getattr(a, name)!r}, "
                             f"receiver {name}={getattr(b, name)!r}")


@dataclass
class StagedKV:
    """One sequence's KV in the receiver's format, ready to ship by block id.

    ``pool`` is laid out by the receiver's plan with ``table.count(q)`` q blocks and
    ``table.count(hp)`` hp blocks; ``table[i]`` is where logical block ``i`` is staged.
    The receiver reserves blocks of the same pools (its block manager does, for a
    prompt of ``num_tokens``) and stores each plane of staged block ``table[i]``
    into its own block ``i``, byte for byte (:meth:`install` does it in process)."""

    pool: KVPool
    table: tuple[BlockRef, ...]
    num_tokens: int
    passthrough: tuple[tuple[int, str], ...] = ()  # (layer, role) whose q blocks are the sender's bytes

    def blocks(self, pool: str) -> list[tuple[int, int]]:
        """``(logical block, staging id)`` of every block staged in ``pool``."""
        return [(i, r.block_id) for i, r in enumerate(self.table) if r.pool == pool]

    def install(self, dst: KVPool, dst_table: Sequence[BlockRef]) -> None:
        """Copy every staged block into ``dst`` (the receiver's pool) at ``dst_table``'s blocks,
        which must be in the same pools as the staged ones."""
        if dst.plan != self.pool.plan:
            raise ValueError("the receiver pool's plan is not the plan these blocks were cast for")
        if [r.pool for r in dst_table[:len(self.table)]] != [r.pool for r in self.table]:
            raise ValueError("receiver table pools differ from the staged layout: "
                             f"{[r.pool for r in dst_table]} vs {[r.pool for r in self.table]}")
        dev = dst.device
        for pool in POOLS:
            pairs = self.blocks(pool)
            if not pairs:
                continue
            src = torch.tensor([s for _, s in pairs], dtype=torch.int64, device=self.pool.device)
            ids = torch.tensor([dst_table[i].block_id for i, _ in pairs], dtype=torch.int64, device=dev)
            for a, b in zip(self.pool.layers, dst.layers):
                for role in ROLES:
                    pa, pb = (a.planes(role), b.planes(role)) if pool == "q" else \
                        ({"hp": a.hp(role)}, {"hp": b.hp(role)})
                    for name, t in pa.items():
                        fp8.index_copy_(pb[name], 0, ids, fp8.index_select(t, 0, src).to(dev))


class SenderCast:
    """Casts sequences of a sender pool into one receiver plan (negotiated once per peer).

    ``static_scales``: the receiver's static FP8 scales, ``{layer: (k_scale, v_scale)}`` as
    :meth:`KVPool.create` takes them.  ``kernels``: a module with ``write_kv`` of the
    receiver's signature (:mod:`kvq.attention.reference` by default; a backend's kernels
    give the same bytes)."""

    def __init__(self, plan: CachePlan, static_scales: dict | None = None, kernels=None):
        self.plan = plan
        self.static_scales = static_scales
        self.kernels = kernels or reference

    def cast(self, src: KVPool, table: Sequence[BlockRef], n: int, device=None, *, into: KVPool | None = None,
             ids: dict[str, Sequence[int]] | None = None) -> StagedKV:
        """The receiver-format blocks of the first ``n`` tokens that ``table`` (the sender's
        block table, any mix of q and hp blocks) holds in ``src``: in a fresh staging pool, or
        ``into`` an existing one of the receiver's plan (a persistent, registered staging area) at
        block ids ``ids[pool][k]`` for the ``k``-th staged block of each pool (zeroed first, so a
        block's bytes are what a fresh pool would hold)."""
        check_geometry(src.plan, self.plan)
        sbs, rbs = src.plan.block_size, self.plan.block_size
        if len(table) < -(-n // sbs):
            raise ValueError(f"{n} tokens need {-(-n // sbs)} sender blocks, the table has {len(table)}")
        rtable = receiver_table(self.plan, n)
        counts = {p: sum(r.pool == p for r in rtable) for p in POOLS}
        if into is None:
            device = src.device if device is None else torch.device(device)
            staged = KVPool.create(self.plan, counts["q"], counts["hp"], device, self.static_scales)
        else:
            staged, device = into, into.device
            if ids is None or any(len(ids[p]) != counts[p] for p in POOLS):
                raise ValueError(f"staging into a pool needs {counts} block ids, got "
                                 f"{ {p: len(v) for p, v in (ids or {}).items()} }")
            rtable = tuple(BlockRef(r.pool, int(ids[r.pool][r.block_id])) for r in rtable)
            _zero_blocks(staged, {p: list(ids[p]) for p in POOLS})
        src_ids = torch.tensor(encode_table(table[:-(-n // sbs)]), dtype=torch.int64, device=src.device)
        slots = _slots(rtable, n, rbs, device)
        passthrough = []
        for li, (a, b) in enumerate(zip(src.layers, staged.layers)):
            k, v = (reference.gather_kv(a, role, src_ids, n, b.k_hp.dtype).transpose(0, 1).contiguous().to(device)
                    for role in ROLES)  # [n, H, D], model dtype
            self.kernels.write_kv(b, k, v, slots)
            for role in ROLES:
                if _same_q(a, b, role):
                    passthrough.append((li, role))
                    _copy_q(a, b, role, table, rtable, n)
        return StagedKV(staged, rtable, n, tuple(passthrough))


def _zero_blocks(pool: KVPool, ids: dict[str, list[int]]) -> None:
    """Zero every plane of the given q and hp blocks of ``pool``."""
    for p, blocks in ids.items():
        if not blocks:
            continue
        idx = torch.tensor(blocks, dtype=torch.int64, device=pool.device)
        for layer in pool.layers:
            for role in ROLES:
                planes = layer.planes(role).values() if p == "q" else (layer.hp(role),)
                for t in planes:
                    fp8.as_bytes(t).index_fill_(0, idx, 0)


def _slots(rtable: Sequence[BlockRef], n: int, bs: int, device) -> torch.Tensor:
    """[n] int64 signed slots (:mod:`kvq.cache.pool`) of tokens ``0..n-1`` in ``rtable``."""
    pos = torch.arange(n, dtype=torch.int64)
    ids = torch.tensor([r.block_id for r in rtable], dtype=torch.int64)[pos // bs]
    is_q = torch.tensor([r.pool == "q" for r in rtable])[pos // bs]
    flat = ids * bs + pos % bs
    return torch.where(is_q, flat, -flat - 1).to(device)


def _same_q(a: LayerKV, b: LayerKV, role: str) -> bool:
    """Whether a q block of ``a`` holds exactly the bytes a q block of ``b`` would (step 4)."""
    fa, fb = a.tensor_format(role), b.tensor_format(role)
    return (fa == fb and fa.is_quantized and a.block_size == b.block_size
            and torch.equal(a.static_scale(role).to(b.static_scale(role).device), b.static_scale(role)))


def _copy_q(a: LayerKV, b: LayerKV, role: str, table, rtable, n: int) -> None:
    """Copy the sender's q blocks of ``role`` into the staged q blocks of the same logical index
    (same block size): whole blocks, or the first tokens of a partly filled last block (only
    per-token formats have those, and their planes all have tokens on axis 2)."""
    bs = a.block_size
    for i, (s, r) in enumerate(zip(table, rtable)):
        if s.pool != "q" or r.pool != "q":
            continue
        rows = min(bs, n - i * bs)
        assert rows == bs or a.tensor_format(role).write_direct, (i, rows)
        for name, t in a.planes(role).items():
            dst, src = fp8.as_bytes(b.planes(role)[name]), fp8.as_bytes(t)
            if rows == bs:
                dst[r.block_id] = src[s.block_id].to(dst.device)
            else:
                dst[r.block_id, :, :rows] = src[s.block_id, :, :rows].to(dst.device)
