"""CUDA graphs for decode steps.

A decode step of an 8B model launches a few hundred small kernels; at batch 1
the host's launch overhead would cost more than the weights take to read.  For
each captured batch size the whole forward (embedding, every layer's K/V write
and split-K decode attention, norm, LM head) is recorded once and replayed.

What makes a step replayable:

* static device buffers for the step's inputs (token ids, positions, slots,
  seals, lengths, block tables): views of one device buffer, refilled before
  each replay by one copy from a pinned host buffer (kvq.engine.staging);
* a launch that depends only on the batch size: the decode kernel's split count
  is chosen for ``max_model_len`` and each sequence divides its own length over
  the splits (kvq.attention.triton.decode);
* a null block: one q block outside the block manager's range.  Padding rows
  (a batch of 5 replays the graph of 8) write their K/V there and attend to it
  with length 1, so they never touch a sequence's blocks.

* seals inside the graph, when the plan can seal (KIVI, per-block FP8, recent
  windows): each layer's seal launch reads a static ``[batch, 2]`` list of
  (hp block, q block) pairs, padded with q block -1 (skipped).  A decode step
  seals at most one block per sequence; a step with more, or with a copy op,
  runs eagerly.
* a tiered cache (elastic precision): every graph decodes each tier by its own
  launch (kvq.cache.step.TierTables), from static tables of each part refilled
  before each replay (a row with no block of a tier has length 0 there), so a
  step whose tables hold lower tiers' blocks replays too.  Its demotions run in
  the graph as well: each layer launches the demotion of every ordered pair of
  tiers from a static ``[DEMOTES_PER_PAIR, 2]`` list, padded with destination -1
  (skipped).  A step with more demotions of one pair, or that moves a block twice
  (the second move must read what the first wrote, an order the fixed launches
  do not keep), runs eagerly; so does the time of a replayed demotion, which is
  not counted apart (kvq.engine.demote_clock times eager steps only).

Prefill and mixed steps run eagerly.
"""

from __future__ import annotations

import bisect
import math
import time

import numpy as np
import torch

from kvq.cache.step import HostStep, StepMetadata, TierTables, split_tiers, table_array
from kvq.engine.staging import Staging, layout, views

#: Rows of a graph's static demotion list per ordered pair of tiers: the age policy moves about one
#: block a sequence every block_size steps, pressure hundreds at once (those steps run eagerly).
DEMOTES_PER_PAIR = 64


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16 to 128, of 32 to 256, of 64 beyond: padding stays under a quarter."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch]
    s = 8
    while s < max_batch:
        s += 16 if s < 128 else 32 if s < 256 else 64
        sizes.append(min(s, max_batch))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    """Captured decode forwards for batch sizes up to ``max_batch``."""

    def __init__(self, model, pool, kernels, device: torch.device, max_batch: int, max_model_len: int,
                 null_block: int, has_hp: bool, can_seal: bool = True):
        self.model, self.pool, self.kernels, self.device = model, pool, kernels, device
        self.sizes = capture_sizes(max_batch)
        self.max_model_len = max_model_len
        self.has_hp = has_hp
        bs = pool.plan.block_size
        self.null_block, self.null_slot = null_block, null_block * bs
        self.width = math.ceil(max_model_len / bs) + 1
        n = self.sizes[-1]
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        # a tiered cache: the base part's and each lower tier's tables and lengths too
        self.num_tiers = pool.plan.num_tiers if pool.layers and pool.layers[0].arena is not None else 0
        parts = 1 + (1 + self.num_tiers if self.num_tiers else 0)
        # every ordered pair of tiers a demotion may move a block between (age moves straight to its tier)
        self.demote_pairs = [(s, d) for s in range(self.num_tiers) for d in range(s + 1, self.num_tiers + 1)]
        # The inputs refilled before each replay are views of one device buffer, so a step's
        # inputs cross in one host->device copy of the buffer's prefix that the batch uses
        # (the tables go last, row-major with their parts side by side, so a batch of g uses their
        # first g rows).
        fields = [np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64),  # ids, positions, slots
                  np.zeros((n, 2), np.int64), np.zeros(n, np.int32),  # seals, lens
                  *(np.zeros((DEMOTES_PER_PAIR, 2), np.int64) for _ in self.demote_pairs),  # demotions
                  *(np.zeros(n, np.int32) for _ in range(parts - 1)),  # base lens, lower tiers' lens
                  np.zeros((n, parts, self.width), np.int32)]  # tables: full, base, lower tiers'
        self._offsets, nbytes = layout(fields)
        self._fields = fields
        self._static = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.ids, self.positions, self.slots, seals, self.lens, *rest, tables = views(self._static, fields,
                                                                                     self._offsets)
        self.demotes, part_lens = rest[:len(self.demote_pairs)], rest[len(self.demote_pairs):]
        self.tables = tables[:, 0]
        self.part_tables = [tables[:, i] for i in range(1, parts)]  # base, tier 1, ...
        self.part_lens = part_lens
        self.slots.fill_(self.null_slot)
        tables.fill_(null_block)
        self.lens.fill_(1)
        for i, x in enumerate(part_lens):
            x.fill_(0 if i else 1)  # lower tiers: no block
        seals.fill_(-1)
        for d in self.demotes:
            d.fill_(-1)
        self.seals = seals if can_seal else None
        self.staging = Staging(device, nbytes)
        self.cu = torch.arange(n + 1, **i32)
        self.rows = torch.arange(n, **i64)
        self.no_blocks = torch.empty(0, 2, **i64)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0

    def _meta(self, b: int) -> StepMetadata:
        tiers = None
        if self.num_tiers:  # every part launched, sized for the longest context (lengths 0 where empty)
            L = self.max_model_len
            tiers = TierTables(self.part_tables[0][:b], self.part_lens[0][:b], L,
                               tuple((t, self.part_tables[t][:b], self.part_lens[t][:b], L)
                                     for t in range(1, self.num_tiers + 1)))
        return StepMetadata(slots=self.slots[:b], full_blocks=self.no_blocks, cu_seqlens_q=self.cu[:b + 1],
                            block_tables=self.tables[:b], seq_lens=self.lens[:b], max_q_len=1,
                            max_seq_len=self.max_model_len, has_hp=self.has_hp, num_decodes=b,
                            prefill_cu=self.cu[:1], seals=None if self.seals is None else self.seals[:b],
                            tiers=tiers, demotes=tuple((s, d, x) for (s, d), x in zip(self.demote_pairs, self.demotes)))

    def _forward(self, b: int) -> torch.Tensor:
        return self.model(self.ids[:b], self.positions[:b], self.pool, self._meta(b), self.kernels, self.rows[:b])

    def capture(self) -> None:
        t0 = time.perf_counter()
        mempool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):  # largest first: later graphs reuse its memory
            self._forward(b)  # compiles the kernels outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                self.outputs[b] = self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0

    def serves(self, step: HostStep) -> bool:
        n = len(step.num_new)
        seals_fit = len(step.seals) <= n if self.seals is not None else not step.seals
        return (0 < n <= self.sizes[-1] and step.num_decodes == n and max(step.seq_lens) <= self.max_model_len
                and seals_fit and self.demotes_fit(step.demotes))

    def demotes_fit(self, demotes) -> bool:
        """Whether a step's demotion runs (kvq.cache.step.demote_runs) fit the graph's static lists: pairs
        the graph launches, at most DEMOTES_PER_PAIR each, and no block moved twice (in the fixed order of
        the launches a second move could read its source before the first wrote it)."""
        if not demotes:
            return True
        count: dict[tuple[int, int], int] = {}
        into: dict[int, set] = {}
        out_of: dict[int, set] = {}
        for s, d, pairs in demotes:
            count[s, d] = count.get((s, d), 0) + len(pairs)
            out_of.setdefault(s, set()).update(a for a, _ in pairs)
            into.setdefault(d, set()).update(b for _, b in pairs)
        return (all(k in self.demote_pairs and n <= DEMOTES_PER_PAIR for k, n in count.items())
                and not any(into[t] & out_of.get(t, set()) for t in into))

    def stage(self, ids: list[int], positions: list[int], step: HostStep) -> int:
        """Fill the static inputs for a batch of ``len(ids)`` (one copy) -> the graph's batch size."""
        b = len(ids)
        g = self.sizes[bisect.bisect_left(self.sizes, b)]
        rows = table_array(step.tables)  # entries past a table's end are never read
        w = rows.shape[1]
        parts = 1 + len(self.part_lens)
        end = self._offsets[-1] + g * parts * self.width * 4
        buf = self.staging.host(self._static.numel())
        ids_h, pos_h, slots_h, seals_h, lens_h, *rest_h, tables_h = (
            t.numpy() for t in views(buf, self._fields, self._offsets))
        demotes_h, part_lens_h = rest_h[:len(self.demote_pairs)], rest_h[len(self.demote_pairs):]
        ids_h[:b], pos_h[:b], slots_h[:b], lens_h[:b] = ids, positions, step.slots, step.seq_lens
        tables_h[:b, 0, :w] = rows
        # padding rows: a token at the null block that attends to it alone
        ids_h[b:g], pos_h[b:g], slots_h[b:g], lens_h[b:g] = 0, 0, self.null_slot, 1
        tables_h[b:g, :, 0] = self.null_block
        if self.num_tiers:
            self._stage_tiers(rows[:b], step.seq_lens, tables_h, part_lens_h, b, g)
        seals_h[:g] = -1
        if step.seals:
            seals_h[:len(step.seals)] = step.seals
        if demotes_h:
            fill = [0] * len(demotes_h)
            for x in demotes_h:
                x[:] = -1
            for s, d, pairs in step.demotes:
                k = self.demote_pairs.index((s, d))
                demotes_h[k][fill[k]:fill[k] + len(pairs)] = pairs
                fill[k] += len(pairs)
        self.staging.send(buf, self._static, end)
        return g

    def _stage_tiers(self, rows: np.ndarray, lens, tables_h: np.ndarray, part_lens_h: list[np.ndarray],
                     b: int, g: int) -> None:
        """The base part's and each lower tier's tables and lengths (kvq.cache.step.split_tiers) of the
        batch's rows; a tier without a block in the step, and the padding rows' tiers, get length 0."""
        split = split_tiers(rows, lens, self.pool.plan.block_size)
        if split is None:
            tables_h[:b, 1, :rows.shape[1]] = rows
            part_lens_h[0][:b] = lens
            present, arrays = [], []
        else:
            arrays, present, _ = split
            tables_h[:b, 1, :arrays[0].shape[1]] = arrays[0]
            part_lens_h[0][:b] = arrays[1]
        part_lens_h[0][b:g] = 1
        for t in range(1, self.num_tiers + 1):
            if t in present:
                i = 2 + 2 * present.index(t)
                tables_h[:b, 1 + t, :arrays[i].shape[1]] = arrays[i]
                part_lens_h[t][:b] = arrays[i + 1]
            else:
                part_lens_h[t][:b] = 0
            part_lens_h[t][b:g] = 0

    def run(self, ids: list[int], positions: list[int], step: HostStep,
            fed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Replay the smallest graph that holds the batch -> logits [B, V] (a view of its output).
        ``fed`` = (rows, device token ids) overrides those rows of ``ids`` on the device (tokens
        the previous step sampled, not known on the host yet)."""
        b = len(ids)
        g = self.stage(ids, positions, step)
        if fed is not None:
            self.ids.index_copy_(0, *fed)
        self.graphs[g].replay()
        return self.outputs[g][:b]
