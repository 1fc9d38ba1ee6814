"""Teacher-forced and greedy passes through one engine's paged, quantized cache.

:class:`CacheSession` takes the place of an :class:`~kvq.engine.llm_engine.LLMEngine`'s
scheduler (which stays idle, its block manager empty): it reserves slots with
the engine's block manager and hands each chunk to the engine's executor
(its :class:`~kvq.engine.model_runner.ModelRunner`, on every rank) as a step, so the
evaluation can keep logits at any position it chooses while using exactly the
engine's cache path::

    bm.allocate_prompt / bm.append_slots       reserve slots chunk by chunk (window rule, lazy sealing)
    SchedulerOutput(ScheduledSeq(slots, table delta, logit rows), ops)
    runner.execute(...)                        seal/copy ops, metadata, forward: each layer
        writes the new K/V into the cache *in its stored format* first, then attends over
        the cache as stored

so every query, including the scored ones, reads the quantized past (only the
tokens the window rule keeps in high precision, sinks and a format's recent
window, are read unquantized).  Chunks start on block boundaries, as the engine's
scheduler requires for formats sealed per block.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kvq.engine.scheduling import ScheduledSeq, SchedulerOutput


class _Chunk:
    """The tokens of one forward pass, as the runner asks a sequence for them."""

    def __init__(self, start: int, tokens: Sequence[int]):
        self.start, self.tokens = start, list(tokens)
        self.num_tokens = start + len(self.tokens)

    def token_ids(self, start: int, end: int) -> list[int]:
        return self.tokens[start - self.start:end - self.start]


class CacheSession:
    """Sequences on one engine's cache, computed chunk by chunk, with timings."""

    def __init__(self, engine):
        if engine.scheduler.has_unfinished() or len(engine.block_manager):
            raise RuntimeError("the engine is busy: a CacheSession needs an idle engine")
        self.engine = engine
        self.bm = engine.block_manager
        self.device = engine.device
        self.block_size = engine.plan.block_size
        self.prefill_tokens = 0
        self.prefill_s = 0.0
        self.decode_tokens = 0
        self.decode_s = 0.0
        self._released: list = []  # freed sequences the runner has not been told of

    def step(self, parts: Sequence[tuple], kind: str = "prefill") -> list[torch.Tensor]:
        """Extend several sequences in one forward pass: ``parts`` = ``(seq_id, tokens, rows)`` each
        (a sequence is created on its first part); -> per part the logits of its new tokens at
        offsets ``rows``, [len(rows), V] float32 on the engine's device.  A multi-token part starts on a block
        boundary; a new sequence must not find a prefix hit (use :meth:`prefill_many`)."""
        planned = []
        self.bm.begin_step()
        for seq_id, tokens, rows in parts:
            tokens = list(tokens)
            if not tokens:
                raise ValueError("a part needs at least one token")
            if seq_id in self.bm:
                start = self.bm.num_tokens(seq_id)
                if len(tokens) > 1 and start % self.block_size:
                    raise ValueError(f"a multi-token chunk must start on a block boundary (at {start})")
                ops = self.bm.append_slots(seq_id, tokens)
            else:
                start, ops = 0, []
                self.bm.allocate_prompt(seq_id, tokens)
                if self.bm.num_computed(seq_id):
                    self.free(seq_id)
                    raise RuntimeError("a new sequence of step() must not find a prefix hit; use prefill_many()")
            planned.append((seq_id, tokens, start, ops, tuple(rows)))
        return self._timed(kind, sum(len(p[1]) for p in planned), lambda: self._forward(planned))

    def _forward(self, planned: list[tuple]) -> list[torch.Tensor]:
        """One runner step over ``(seq_id, tokens, start, ops, rows)`` items (slots reserved)."""
        items, chunks, ops = [], {}, []
        for seq_id, tokens, start, part_ops, rows in planned:
            end = start + len(tokens)
            t0, refs, tlen = self.bm.table_delta(seq_id)
            items.append(ScheduledSeq(seq_id, len(tokens), start, is_prefill=len(tokens) > 1, sample=False,
                                      slots=tuple(self.bm.slots(seq_id, start, end)), table_start=t0,
                                      table_refs=refs, table_len=tlen, logit_rows=rows))
            chunks[seq_id] = _Chunk(start, tokens)
            ops += part_ops
        step = SchedulerOutput(tuple(items), tuple(ops), (), sum(len(p[1]) for p in planned),
                               tuple(self._released))
        self._released.clear()
        logits, _ = self.engine.executor.execute(step, chunks)  # every rank under tensor parallelism
        for seq_id, tokens, start, _, _ in planned:
            self.bm.mark_computed(seq_id, start + len(tokens))
        if logits is None:
            return [torch.empty(0, self.engine.model.config.vocab_size, device=self.device) for _ in planned]
        # a copy (a replayed CUDA graph's output is overwritten by the next replay), kept on the device:
        # the figures computed from it (log-softmax, KL, argmax) run there
        return list(logits.to(torch.float32, copy=True).split([len(p[4]) for p in planned]))

    def _timed(self, kind: str, n: int, fn):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t = time.perf_counter()
        out = fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t
        if kind == "prefill":
            self.prefill_tokens, self.prefill_s = self.prefill_tokens + n, self.prefill_s + dt
        else:
            self.decode_tokens, self.decode_s = self.decode_tokens + n, self.decode_s + dt
        return out

    def append(self, seq_id, tokens: Sequence[int], rows: Sequence[int] = (), kind: str = "prefill") -> torch.Tensor:
        """Extend ``seq_id`` (created on first use) by ``tokens`` in one forward pass.

        Returns the logits of the new tokens at offsets ``rows`` ([len(rows), V]).
        """
        return self.step([(seq_id, tokens, rows)], kind)[0]

    def prefill(self, seq_id, tokens: Sequence[int], chunk: int, rows: Sequence[int] = ()) -> torch.Tensor:
        """:meth:`prefill_many` of one prompt."""
        return self.prefill_many([(seq_id, tokens, rows)], chunk)[0]

    def prefill_many(self, prompts: Sequence[tuple], chunk: int) -> list[torch.Tensor]:
        """Prefill prompts ``(seq_id, tokens, rows)`` side by side, as the engine's scheduler does: each
        reuses its cached prefix, then its next block-aligned chunk of at most ``chunk`` tokens joins
        every step until it is done, each chunk reserved just before it runs (the blocks before a
        chunk settle at its start); -> per prompt its logits at absolute positions ``rows`` (each at
        or after its prefix hit)."""
        chunk = max(self.block_size, chunk // self.block_size * self.block_size)
        state = []  # [seq_id, tokens, rows, next position, first chunk?, logits]
        self.bm.begin_step()
        try:
            for seq_id, tokens, rows in prompts:
                tokens = list(tokens)
                hit = self.bm.allocate_prompt(seq_id, tokens,
                                              end=lambda h, n=len(tokens): min(h + chunk, n)).num_cached_tokens
                state.append([seq_id, tokens, list(rows), hit, True, []])
                if any(r < hit for r in rows):
                    raise ValueError(f"rows {list(rows)} fall in the cached prefix (first {hit} tokens)")
        except Exception:
            for st in state:
                self.free(st[0])
            raise
        first_round = True
        while any(st[3] < len(st[1]) for st in state):
            if not first_round:  # (the first chunks were reserved with the prompts, in this step)
                self.bm.begin_step()
            first_round = False
            planned, owners = [], []
            for st in state:
                seq_id, tokens, rows, start, first, _ = st
                if start >= len(tokens):
                    continue
                end = min(start + chunk, len(tokens))
                ops = [] if first else self.bm.append_slots(seq_id, tokens[start:end])
                planned.append((seq_id, tokens[start:end], start, ops, tuple(r - start for r in rows
                                                                              if start <= r < end)))
                owners.append(st)
                st[3], st[4] = end, False
            got = self._timed("prefill", sum(len(p[1]) for p in planned), lambda: self._forward(planned))
            for st, p, lg in zip(owners, planned, got):
                if p[4]:
                    st[5].append(lg)
        return [torch.cat(st[5]) if st[5] else torch.empty(0) for st in state]

    def greedy(self, parent, first_logits: torch.Tensor, n: int, child="greedy") -> list[int]:
        """:meth:`greedy_many` of one sequence."""
        return self.greedy_many([(parent, first_logits, child)], n)[0]

    def greedy_many(self, starts: Sequence[tuple], n: int) -> list[list[int]]:
        """Greedy continuations of ``n`` tokens, decoded side by side: ``starts`` = ``(parent,
        first_logits [V], child)``, the parent's next-token logits after its last token; each runs
        on a fork ``child`` of its parent (shared blocks, copy-on-write), the parents unchanged."""
        forked = []
        try:
            for parent, _, child in starts:
                self.bm.fork(parent, child)
                forked.append(child)
            out = [[t] for t in torch.stack([lg.reshape(-1) for _, lg, _ in starts]).argmax(-1).tolist()]
            while len(out[0]) < n:
                got = self.step([(child, [o[-1]], (0,)) for o, (_, _, child) in zip(out, starts)], kind="decode")
                for o, t in zip(out, torch.cat(got).argmax(-1).tolist()):  # one device->host copy a step
                    o.append(t)
        finally:
            for child in forked:
                self.free(child)
        return out

    def free(self, seq_id) -> None:
        self.bm.free(seq_id)
        self._released.append(seq_id)

    def throughput(self) -> dict:
        """Measured tokens per second of this session's prefill chunks and single-sequence decode steps."""
        return {
            "prefill_tokens": self.prefill_tokens,
            "prefill_tokens_per_s": self.prefill_tokens / self.prefill_s if self.prefill_s else None,
            "decode_tokens": self.decode_tokens,
            "decode_tokens_per_s": self.decode_tokens / self.decode_s if self.decode_s else None,
        }
