"""Host-side preparation of one step's cache metadata, and its data movement.

The block manager decides (tensor-free); this module turns its decisions into
the int tensors the kernels take, in one place, and runs the seal/copy ops it
returned.  Order within a step (block_manager's contract):

    ops = manager.append_slots(...)   # for every sequence in the step
    apply_ops(pool, kernels, ops)     # seals and copy-on-write, before any write
    kernels.write_kv(...)             # new tokens' K/V, per layer
    kernels.paged_attention(...)      # reads the cache, per layer
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvq.cache.block_manager import BlockManager, CopyOp, DemoteOp, SealOp, SwapOp, WipeOp
from kvq.cache.tiers import pool_tier
from kvq.cache.pool import TIER_BASE, KVPool, encode_slots, encode_table
from kvq.cache.window import WindowPolicy, can_seal, exact_from


@dataclass(frozen=True)
class StepMetadata:
    """Tensors of one step, on the pool's device.

    slots          [T] int64     signed slot of each new token (kvq.cache.pool)
    full_blocks    [NB, 2] int64 q blocks filled whole by this write (block-sealed formats)
    cu_seqlens_q   [B + 1] int32
    block_tables   [B, max_blocks] int32, signed
    seq_lens       [B] int32     tokens in cache after this step
    max_q_len, max_seq_len, has_hp: host ints/bools for the launch (no device sync)
    num_decodes    leading sequences with one new token each: they go to the decode kernel
    prefill_cu     [B - num_decodes + 1] int32  cu_seqlens_q of the other sequences, from 0
    seals          [S, 2] int64  (hp block, q block) seals each layer runs before its K/V
                   write (rows with a negative q block are padding), or None
    prefill_host   (cu, lens) of the prefill sequences as host tuples (``prefill_cu`` and their
                   ``seq_lens``): what a library prefill plans its calls with, once per step
    tiers          the decode rows' tables split by tier (:class:`TierTables`) when one of them holds a
                   block of a lower tier (elastic precision), else None
    prefill_tiers  a prefill row's table holds a lower tier's block (host bool): the prefill reads its
                   pages by tag; fresh prompts beside decodes that hold demoted blocks keep the direct path
    demotes        ((src tier, dst tier, [S, 2] int64 (src block, dst block)), ...): blocks re-stored one
                   tier down in every layer (one launch a run) before the first layer's seals and K/V
                   write, deepest source first
    """

    slots: torch.Tensor
    full_blocks: torch.Tensor
    cu_seqlens_q: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    max_q_len: int
    max_seq_len: int
    has_hp: bool
    num_decodes: int = 0
    prefill_cu: torch.Tensor | None = None
    seals: torch.Tensor | None = None
    window: PrefillWindow | None = None
    prefill_host: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    tiers: TierTables | None = None
    prefill_tiers: bool = False
    demotes: tuple[tuple[int, int, torch.Tensor], ...] = ()


@dataclass(frozen=True)
class TierTables:
    """A decode step's tables split by tier (elastic precision, kvq.cache.tiers): ``base`` holds each
    sequence's hp and resident blocks in order with the lower tiers' blocks left out (their lengths
    shortened by them), ``tiers`` one table of tier-local block ids per lower tier in the step.
    A decode reads every key of its sequence, so each part is attended with its own format's
    kernel and the parts merge by log-sum-exp; a lower tier's blocks are always whole.

    base_tables [B, W] int32, base_lens [B] int32, base_max_len (host)
    tiers       ((tier, tables [B, Wt] int32, lens [B] int32, max_len), ...)
    """

    base_tables: torch.Tensor
    base_lens: torch.Tensor
    base_max_len: int
    tiers: tuple[tuple[int, torch.Tensor, torch.Tensor, int], ...]


def split_tiers(table: np.ndarray, lens: Sequence[int], block_size: int
                ) -> tuple[list[np.ndarray], list[int], list[int]] | None:
    """Host half of :class:`TierTables` for rows ``table`` ``[B, W]`` (signed, tagged) of lengths
    ``lens``: -> ([base table, base lens, tier 1 table, tier 1 lens, ...] as int32 arrays, the tiers
    present, each part's longest length); None when no row holds a lower tier's block."""
    B = table.shape[0]
    if B == 0:
        return None
    lens = np.asarray(lens, np.int64)
    used = np.arange(table.shape[1])[None, :] < -(-lens // block_size)[:, None]
    tier = np.where(table < 0, 0, table // TIER_BASE)
    tier[~used] = -1
    present = sorted(int(t) for t in np.unique(tier) if t > 0)
    if not present:
        return None
    ends = np.nonzero(lens % block_size)[0]  # rows whose last block is partial: it must be hp or resident
    if ends.size and (tier[ends, lens[ends] // block_size] > 0).any():
        raise ValueError("a lower tier's blocks are whole: a row ends inside one (only sealed blocks move down)")
    arrays, maxes = [], []
    lower = np.zeros(B, np.int64)
    for t in [0, *present]:
        mask = tier == t
        count = mask.sum(axis=1)
        order = np.argsort(~mask, axis=1, kind="stable")[:, :max(int(count.max()), 1)]
        part = np.take_along_axis(table, order, axis=1)
        part = np.where(np.arange(part.shape[1])[None, :] < count[:, None], part - t * TIER_BASE, 0)
        if t:
            lower += count
            n = count * block_size
        arrays += [part.astype(np.int32), None if t == 0 else n.astype(np.int32)]
    arrays[1] = (lens - lower * block_size).astype(np.int32)
    maxes = [int(a.max()) for a in arrays[1::2]]
    return arrays, present, maxes


@dataclass(frozen=True)
class PrefillWindow:
    """What the step's prefill queries read beyond the cache as stored, so that each query
    reads exact exactly the keys :func:`kvq.cache.window.exact_from` gives it (its recent
    window and the sinks) and every other key quantized, whatever the prefill chunk.

    exact   [E, 3] int64  (prefill sequence, logical block, row of the block's first token
                          among the step's prefill rows): q blocks this step writes; the
                          queries whose window holds them read the new K/V instead
    sealed  [S, 3] int64  (prefill sequence, logical block, hp block id): hp blocks that some
                          query of the step reads quantized, as they will be sealed
    policy  the window rule's constants (host)
    exact_rows, sealed_rows: the same lists on the host (the torch reference reads them)
    cu, lens: host prefill cu_seqlens and lengths (launch grouping)
    """

    exact: torch.Tensor
    sealed: torch.Tensor
    policy: WindowPolicy
    exact_rows: tuple[tuple[int, int, int], ...]
    sealed_rows: tuple[tuple[int, int, int], ...]
    cu: tuple[int, ...]
    lens: tuple[int, ...]

    @property
    def sink_tokens(self) -> int:
        return self.policy.sink_blocks * self.policy.block_size


def prefill_window_rows(step: HostStep, table: np.ndarray, policy: WindowPolicy | None):
    """(exact, sealed) rows of :class:`PrefillWindow` for the step's prefill sequences, or None
    without a windowed format or a prefill.  Both lists may be empty (no block read differently
    from how it is stored): the kernels then read the cache as stored, and the reference still
    splits each query's keys by the rule (the same arithmetic whatever the chunk)."""
    if policy is None or not can_seal(policy) or len(step.num_new) == step.num_decodes:
        return None
    bs, nd = policy.block_size, step.num_decodes
    exact, sealed = [], []
    row = 0
    for b, k in enumerate(range(nd, len(step.num_new))):
        n, t = step.seq_lens[k], step.num_new[k]
        s, last = n - t, exact_from(n - 1, policy)
        # past the sinks, hp blocks lie in the window at the chunk's start or later (earlier ones were
        # sealed, or born sealed), and listed q blocks lie in the chunk: scan from a block before that window
        lo = max(policy.sink_blocks, (s - policy.residual_tokens) // bs - 1)
        for i in range(lo, -(-n // bs)):
            ref = int(table[k, i])
            if ref < 0:
                if policy.sink_blocks <= i and (i + 1) * bs <= last:
                    sealed.append((b, i, -ref - 1))
            elif i * bs >= s:  # a q block this step writes: whole, inside the chunk
                exact.append((b, i, row + i * bs - s))
        row += t
    return exact, sealed


def _full_blocks(slots: list[int], block_size: int) -> list[tuple[int, int]]:
    """q blocks whose every slot appears, in order, in this write."""
    out, i = [], 0
    while i < len(slots):
        s = slots[i]
        last = i + block_size - 1
        if s >= 0 and s % block_size == 0 and last < len(slots) and slots[last] == s + block_size - 1:
            out.append((s // block_size, i))
            i += block_size
        else:
            i += 1
    return out


@dataclass(frozen=True)
class HostStep:
    """A step's metadata on the host (what :class:`StepMetadata` holds on the device).

    ``tables`` is a list of signed tables, or a ``[B, W]`` int32 numpy array whose
    rows hold 0 past each table's end (the runner's gathered mirror)."""

    slots: list[int]
    tables: list[list[int]] | np.ndarray
    seq_lens: list[int]
    num_new: list[int]
    seals: list[tuple[int, int]] = ()  # (hp block, q block): sealed by each layer before its write
    demotes: tuple[tuple[int, int, list[tuple[int, int]]], ...] = ()  # (src tier, dst tier, pairs), deepest first

    @property
    def num_decodes(self) -> int:
        nd = 0
        while nd < len(self.num_new) and self.num_new[nd] == 1:
            nd += 1
        return nd


def host_step(manager: BlockManager, seq_ids: Sequence, num_new: Sequence[int],
              starts: Sequence[int] | None = None) -> HostStep:
    """Slots, signed tables and lengths for a step computing tokens ``[starts[b], starts[b] +
    num_new[b])`` of each sequence (default: its last ``num_new[b]`` tokens)."""
    bs = manager.block_size
    slots: list[int] = []
    tables: list[list[int]] = []
    lens: list[int] = []
    for i, (sid, k) in enumerate(zip(seq_ids, num_new)):
        n = manager.num_tokens(sid) if starts is None else starts[i] + k
        slots += encode_slots(manager.slots(sid, n - k, n), bs)
        tables.append(encode_table(manager.block_table(sid)))
        lens.append(n)
    return HostStep(slots, tables, lens, list(num_new))


def build_metadata(
    manager: BlockManager, seq_ids: Sequence, num_new: Sequence[int], device: torch.device | str,
    starts: Sequence[int] | None = None,
) -> StepMetadata:
    """Metadata for a step computing tokens ``[starts[b], starts[b] + num_new[b])`` of each
    sequence (default: its last ``num_new[b]`` tokens); attention sees the cache up to there."""
    return to_device(host_step(manager, seq_ids, num_new, starts), manager.block_size, device)


def table_array(tables: list[list[int]] | np.ndarray) -> np.ndarray:
    """Signed tables as a ``[B, W]`` int32 array, rows padded with 0."""
    if isinstance(tables, np.ndarray):
        return tables
    width = max((len(t) for t in tables), default=0)
    out = np.zeros((len(tables), width), np.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return out


def host_ids(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` (ints, or tuples of ints) as a tensor on ``device`` without waiting for the device: on
    CUDA through pinned memory and an asynchronous copy.  ``torch.tensor(values, device=cuda)`` copies
    from pageable memory and then synchronizes the stream, i.e. waits for every launch queued before it
    (under asynchronous scheduling, the previous step's forward), which serializes the host's work for
    the step with the device's."""
    return _no_wait_to(torch.tensor(values, dtype=dtype), torch.device(device))


def _no_wait_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor ``t`` on ``device``; on CUDA pinned first, so the copy does not wait for the stream."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def each_to(device: torch.device | str):
    """A stager that copies each array on its own (pinned on CUDA): tests and one-off drivers.
    The engine's runner stages a step's arrays through one copy (kvq.engine.staging)."""
    dev = torch.device(device)

    def stage(arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        return [_no_wait_to(torch.from_numpy(np.ascontiguousarray(a)), dev) for a in arrays]
    return stage


def stage_step(step: HostStep, block_size: int, stage, extra: Sequence[np.ndarray] = (),
               policy: WindowPolicy | None = None, tiered: bool = True) -> tuple[StepMetadata, list[torch.Tensor]]:
    """The step's metadata on the device, with ``extra`` arrays (the runner's token ids,
    positions, logit rows) staged in the same call: ``stage(list of numpy arrays) -> tensors``.
    With the cache's window ``policy`` the prefill queries get their exact windows
    (:class:`PrefillWindow`).  ``tiered=False`` (an untiered pool) skips the scan of the tables for a
    lower tier's blocks (:class:`TierTables`)."""
    num_new = step.num_new
    cu = np.zeros(len(num_new) + 1, np.int32)
    np.cumsum(num_new, out=cu[1:])
    table = np.ascontiguousarray(table_array(step.tables), dtype=np.int32)
    nd = step.num_decodes
    fb = np.asarray(_full_blocks(step.slots, block_size), np.int64).reshape(-1, 2)
    seals = np.asarray(step.seals, np.int64).reshape(-1, 2)
    rows = prefill_window_rows(step, table, policy)
    win = [np.asarray(r, np.int64).reshape(-1, 3) for r in rows] if rows else []
    # each side on its own rows: a step whose decodes hold demoted blocks while its prompts are fresh (an
    # age under the prompt length ages every sequence from its first decode) keeps the prompts' direct
    # path (the tiered one re-reads each page through a scratch: +4% on the prompt steps, H100 profile)
    lower = (table >= TIER_BASE) if tiered and table.size else None
    split = (split_tiers(table[:nd], step.seq_lens[:nd], block_size)
             if lower is not None and lower[:nd].any() else None)
    demotes = [(s_, d_, np.asarray(pairs, np.int64).reshape(-1, 2)) for s_, d_, pairs in step.demotes]
    arrays = [np.asarray(step.slots, np.int64), fb, cu, table, np.asarray(step.seq_lens, np.int32),
              cu[nd:] - cu[nd], seals, *extra, *win, *(split[0] if split else ()), *(d[2] for d in demotes)]
    t = stage(arrays)
    n_split = len(split[0]) if split else 0
    extra_t, win_t = t[7:7 + len(extra)], t[7 + len(extra):7 + len(extra) + len(win)]
    split_t = t[7 + len(extra) + len(win):7 + len(extra) + len(win) + n_split]
    demote_t = t[7 + len(extra) + len(win) + n_split:]
    tiers = None
    if split:
        _, present, maxes = split
        tiers = TierTables(split_t[0], split_t[1], maxes[0],
                           tuple((tt, split_t[2 + 2 * i], split_t[3 + 2 * i], maxes[1 + i])
                                 for i, tt in enumerate(present)))
    window = None
    host = (tuple(int(c) for c in cu[nd:] - cu[nd]), tuple(int(n) for n in step.seq_lens[nd:]))
    if rows:
        window = PrefillWindow(*win_t, policy, tuple(map(tuple, rows[0])), tuple(map(tuple, rows[1])), *host)
    meta = StepMetadata(
        slots=t[0], full_blocks=t[1], cu_seqlens_q=t[2], block_tables=t[3], seq_lens=t[4],
        max_q_len=max(num_new, default=0),
        max_seq_len=max(step.seq_lens, default=0),
        has_hp=bool((table < 0).any()),
        num_decodes=nd,
        prefill_cu=t[5],
        seals=t[6] if step.seals else None,
        window=window,
        prefill_host=host if nd < len(num_new) else None,
        tiers=tiers,
        prefill_tiers=lower is not None and bool(lower[nd:].any()),
        demotes=tuple((s_, d_, x) for (s_, d_, _), x in zip(demotes, demote_t)),
    )
    return meta, extra_t


def to_device(step: HostStep, block_size: int, device: torch.device | str) -> StepMetadata:
    return stage_step(step, block_size, each_to(device))[0]


def demote_runs(ops: Sequence[DemoteOp]) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """Demotions as runs of one tier pair, in the order made: ``(src tier, dst tier, [(src, dst)])``."""
    runs: list[tuple[int, int, list[tuple[int, int]]]] = []
    for op in ops:
        s, d = pool_tier(op.src.pool), pool_tier(op.dst.pool)
        if not runs or runs[-1][:2] != (s, d):
            runs.append((s, d, []))
        runs[-1][2].append((op.src.block_id, op.dst.block_id))
    return runs


def layer_ops(ops: Sequence) -> tuple[list[tuple[int, int]], list] | None:
    """The step's ops as the forward runs them (demotions, every layer's, before the first layer; seals,
    each layer's just before it writes its own K/V), when they are all seals and demotions: ((hp block,
    q block) seal pairs (:attr:`StepMetadata.seals`), demotion runs (:func:`demote_runs`,
    :attr:`StepMetadata.demotes`)); every demotion runs before every seal,
    which is the manager's order where it matters (a demoted source may be sealed into; a block sealed
    in the step is never demoted in it).  None when a copy or a swap is among them and
    :func:`apply_ops` must run the whole list first, in order."""
    if not all(isinstance(op, (SealOp, DemoteOp)) for op in ops):
        return None
    return ([(op.src_hp_block, op.dst_q_block) for op in ops if isinstance(op, SealOp)],
            demote_runs([op for op in ops if isinstance(op, DemoteOp)]))


def apply_ops(pool: KVPool, kernels, ops: Sequence, swap=None) -> None:
    """Run seal, demotion, copy-on-write and swap ops in the order the manager returned them.

    Order matters: a seal's hp source or a swapped-out block is already free in the
    manager, and a later op of the same step may reuse it.  Consecutive ops of one
    kind are batched into one launch per layer.  Each run of swaps goes to ``swap``
    (the worker's swap connector, ``swap.issue(ops)``: kvq.connectors.swap), which
    copies on the host pool's copy stream and has the current stream wait for it
    before anything after it (no host sync): a block swapped out is copied before a
    later write reuses it, one swapped in is there before it is read.
    """
    i = 0
    while i < len(ops):
        j = i
        while j < len(ops) and type(ops[j]) is type(ops[i]):
            j += 1
        run = ops[i:j]
        if isinstance(run[0], SealOp):
            src = host_ids([op.src_hp_block for op in run], torch.int64, pool.device)
            dst = host_ids([op.dst_q_block for op in run], torch.int64, pool.device)
            for layer in pool.layers:
                kernels.seal_blocks(layer, src, dst)
        elif isinstance(run[0], CopyOp):
            for op in run:  # rare (forked sequences); one block at a time keeps pools apart
                src = host_ids([op.src.block_id], torch.int64, pool.device)
                dst = host_ids([op.dst.block_id], torch.int64, pool.device)
                pool.copy_blocks(op.src.pool, src, dst)
        elif isinstance(run[0], DemoteOp):
            for s_, d_, pairs in demote_runs(run):
                kernels.demote_layers(pool.layers, host_ids(pairs, torch.int64, pool.device), s_, d_)
        elif isinstance(run[0], WipeOp):
            idx = host_ids(sorted({s for op in run for s in op.slabs}), torch.int64, pool.device)
            for layer in pool.layers:  # (each layer's arena: num_slabs rows of its slab bytes)
                if layer.arena is not None and layer.arena.numel():
                    layer.arena.view(pool.num_slabs, -1).index_fill_(0, idx, 0)
        elif isinstance(run[0], SwapOp):
            if swap is None:
                raise RuntimeError("a swap op without a host tier (preemption_mode='swap' needs cpu_offload_gb)")
            swap.issue(run)
        else:
            raise TypeError(f"unknown cache op {run[0]!r}")
        i = j
