"""Turns a scheduler decision into one forward pass over the paged cache.

The scheduler's output is the whole input: each scheduled sequence carries its
new tokens' cache slots and the block-table entries that changed, which the
runner applies to its mirror of the tables (:mod:`kvq.engine.block_tables`);
the runner never reads the block manager.  Host metadata is built here and
copied to the device once.  The block manager's ordering contract (a seal reads
its hp block before any K/V of the step is written) holds per layer: a step whose
ops are all seals hands them to the forward, where each layer seals just before
its own write (inside the CUDA graph of a decode step); copies run before the
forward.  Pure decode steps replay a
CUDA graph when the engine captured them (:mod:`kvq.engine.cuda_graphs`).
"""

from __future__ import annotations

import numpy as np
import torch

from kvq.cache.pool import encode_slots
from kvq.cache.step import HostStep, apply_ops, layer_ops, stage_step
from kvq.engine.block_tables import BlockTables
from kvq.engine.demote_clock import DemoteClock
from kvq.engine.staging import Staging


class ModelRunner:
    def __init__(self, model, pool, kernels, device: torch.device, graphs=None, max_num_seqs: int = 64,
                 swap=None):
        self.model, self.pool, self.kernels, self.device = model, pool, kernels, device
        # a tiered cache's forward runs its demotions: timed apart (kvq.engine.demote_clock)
        self.demote_clock = DemoteClock(kernels, device.type == "cuda") if getattr(pool, "layout", None) else None
        self.swap = swap  # the "swap" KV connector that copies swap ops (kvq.connectors.swap), or None
        self.block_size = pool.plan.block_size
        self.graphs = graphs  # DecodeGraphs or None (eager)
        self.graph_steps = 0
        self.tables = BlockTables(rows=max_num_seqs)
        self.staging = Staging(device)  # eager steps: every input array in one host->device copy
        self.warmup = None  # kvq.cache.scales_warmup.WarmupScales while static scales are measured

    def apply_ops(self, ops) -> None:
        """Run a step's cache ops (seals, copies, swaps) in order, before anything writes KV."""
        apply_ops(self.pool, self.demote_clock or self.kernels, ops, self.swap)

    def execute(self, sched, seqs: dict, feed: tuple[torch.Tensor, dict] | None = None
                ) -> tuple[torch.Tensor | None, list[int]]:
        """Run the step; -> (logits [R + P, V]: the R rows of every item's ``logit_rows``, in order,
        then the P rows of their ``prompt_rows``, in order; or None when no item asks for any row;
        the sequence id of each of the R rows).  ``seqs[seq_id].token_ids(a, b)``
        gives the tokens of positions [a, b).

        ``feed`` (asynchronous scheduling): the previous step's sampled ids on the device
        and their row per sequence.  A scheduled token not known on the host yet (the
        last position of a sequence, sampled by that step) is read from there on the
        device, so the step is enqueued without waiting for the previous one."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[tuple[str, int, int]] = []
        seq_ids, lens, nums, logits_rows, sample_ids, prompt_rows = [], [], [], [], [], []
        fed_at, fed_rows = [], []  # positions in ids, rows of feed[0]
        tables = self.tables
        tables.release(sched.released)
        for item in sched.scheduled:
            seq, end = seqs[item.seq_id], item.start + item.num_new_tokens
            tokens = seq.token_ids(item.start, end)
            assert item.num_new_tokens == len(item.slots), item
            if len(tokens) < item.num_new_tokens:  # the last one is in flight
                assert feed is not None and len(tokens) == item.num_new_tokens - 1, (item, seq.num_tokens)
                fed_at.append(len(ids) + len(tokens))
                fed_rows.append(feed[1][item.seq_id])
                tokens = tokens + [0]
            ids += tokens
            positions += range(item.start, end)
            slots += item.slots
            tables.update(item.seq_id, item.table_start, item.table_refs, item.table_len)
            seq_ids.append(item.seq_id)
            lens.append(end)
            nums.append(item.num_new_tokens)
            base = len(ids) - item.num_new_tokens
            for off in item.logit_rows:
                logits_rows.append(base + off)
                sample_ids.append(item.seq_id)
            if item.prompt_rows:  # rare (prompt_logprobs): no generator per item on the hot path
                prompt_rows += (base + off for off in item.prompt_rows)
        in_layers = layer_ops(sched.ops)  # seals and demotions, run inside the forward
        if in_layers is None:
            self.apply_ops(sched.ops)
        seals, demotes = in_layers or ((), ())
        step = HostStep(encode_slots(slots, self.block_size), tables.gather(seq_ids), lens, nums, seals,
                        tuple(demotes))
        i64 = [np.int64] * 2
        if (self.graphs is not None and self.warmup is None and logits_rows == list(range(len(ids)))
                and not prompt_rows and self.graphs.serves(step)):
            self.graph_steps += 1
            fed = None
            if fed_at:
                at, rows = self.staging.pack([fed_at, fed_rows], i64)
                fed = (at, feed[0].index_select(0, rows))
            return self.graphs.run(ids, positions, step, fed), sample_ids
        scored = logits_rows + prompt_rows
        rows = scored or [len(ids) - 1]
        # one copy: the metadata, ids, positions, logit rows, and where the fed tokens go
        meta, (ids_dev, pos_dev, rows_dev, at, fed_src) = stage_step(
            step, self.block_size, self.staging.pack,
            [np.asarray(x, np.int64) for x in (ids, positions, rows, fed_at, fed_rows)],
            policy=self.pool.plan.window_policy, tiered=self.pool.layout is not None)
        if fed_at:
            ids_dev.index_copy_(0, at, feed[0].index_select(0, fed_src))
        kernels = self.demote_clock if meta.demotes and self.demote_clock is not None else self.kernels
        logits = self.model(ids_dev, pos_dev, self.pool, meta, kernels, rows_dev)
        if self.warmup is not None and self.warmup.advance(len(ids)):
            self.pool.observer, warmup, self.warmup = None, self.warmup, None
            warmup.freeze()  # enqueued after this step's forward, before the next one
        return (logits if scored else None), sample_ids
