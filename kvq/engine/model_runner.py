"""Turns a scheduler decision into one forward pass over the paged cache.

Host-side metadata is built in one place (:func:`kvq.cache.step.host_step`)
and copied to the device once; the seal/copy ops the block manager returned
run before any K/V of the step is written (its ordering contract).  Pure decode
steps replay a CUDA graph when the engine captured them
(:mod:`kvq.engine.cuda_graphs`).
"""

from __future__ import annotations

import torch

from kvq.cache.step import apply_ops, host_step, to_device


class ModelRunner:
    def __init__(self, model, pool, block_manager, kernels, device: torch.device, graphs=None):
        self.model, self.pool, self.block_manager, self.kernels, self.device = model, pool, block_manager, kernels, device
        self.graphs = graphs  # DecodeGraphs or None (eager)
        self.graph_steps = 0

    def execute(self, sched, seqs: dict) -> tuple[torch.Tensor | None, list[int]]:
        """Run the step; -> (logits [S, V] of the rows that sample, their sequence ids in order)."""
        ids: list[int] = []
        positions: list[int] = []
        seq_ids, starts, nums, logits_rows, sample_ids = [], [], [], [], []
        for item in sched.scheduled:
            seq = seqs[item.seq_id]
            tokens = seq.token_ids(item.start, item.start + item.num_new_tokens)
            assert len(tokens) == item.num_new_tokens, (item, seq.num_tokens)
            ids += tokens
            positions += range(item.start, item.start + item.num_new_tokens)
            seq_ids.append(item.seq_id)
            starts.append(item.start)
            nums.append(item.num_new_tokens)
            if item.sample:
                logits_rows.append(len(ids) - 1)
                sample_ids.append(item.seq_id)
        apply_ops(self.pool, self.kernels, sched.ops)
        step = host_step(self.block_manager, seq_ids, nums, starts=starts)
        if self.graphs is not None and len(logits_rows) == len(seq_ids) and self.graphs.serves(step):
            self.graph_steps += 1
            return self.graphs.run(ids, positions, step), sample_ids
        meta = to_device(step, self.block_manager.block_size, self.device)
        pin = self.device.type == "cuda"

        def dev(x):
            t = torch.tensor(x, dtype=torch.int64)
            return t.pin_memory().to(self.device, non_blocking=True) if pin else t

        rows = logits_rows or [len(ids) - 1]
        logits = self.model(dev(ids), dev(positions), self.pool, meta, self.kernels, dev(rows))
        return (logits if logits_rows else None), sample_ids
