"""Teacher-forced and greedy passes through one engine's paged, quantized cache.

:class:`CacheSession` takes the place of an :class:`~kvq.engine.llm_engine.LLMEngine`'s
scheduler (which stays idle, its block manager empty): it reserves slots with
the engine's block manager and hands each chunk to the engine's own
:class:`~kvq.engine.model_runner.ModelRunner` as a one-sequence step, so the
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

from kvq.engine.scheduler import ScheduledSeq, SchedulerOutput


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

    def _forward(self, seq_id, tokens: Sequence[int], start: int, ops, rows: Sequence[int]) -> torch.Tensor:
        """Compute positions [start, start + len(tokens)) of ``seq_id``; logits [len(rows), V] float32 on the CPU."""
        end = start + len(tokens)
        t0, refs, tlen = self.bm.table_delta(seq_id)
        item = ScheduledSeq(seq_id, len(tokens), start, is_prefill=len(tokens) > 1, sample=False,
                            slots=tuple(self.bm.slots(seq_id, start, end)), table_start=t0, table_refs=refs,
                            table_len=tlen, logit_rows=tuple(rows))
        step = SchedulerOutput((item,), tuple(ops), (), len(tokens), tuple(self._released))
        self._released.clear()
        logits, _ = self.engine.runner.execute(step, {seq_id: _Chunk(start, tokens)})
        self.bm.mark_computed(seq_id, end)
        if logits is None:
            return torch.empty(0, self.engine.model.config.vocab_size)
        return logits.float().cpu()

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
        tokens = list(tokens)
        if not tokens:
            raise ValueError("append needs at least one token")
        if seq_id in self.bm:
            start = self.bm.num_tokens(seq_id)
            if len(tokens) > 1 and start % self.block_size:
                raise ValueError(f"a multi-token chunk must start on a block boundary (at {start})")
            ops = self.bm.append_slots(seq_id, tokens)
        else:
            start, ops = 0, []
            self.bm.allocate_prompt(seq_id, tokens)
            if self.bm.num_computed(seq_id):  # a prefix hit: recompute nothing twice, but keep it simple
                self.free(seq_id)
                raise RuntimeError("CacheSession.append does not take prefix hits; use prefill()")
        return self._timed(kind, len(tokens), lambda: self._forward(seq_id, tokens, start, ops, rows))

    def prefill(self, seq_id, tokens: Sequence[int], chunk: int, rows: Sequence[int] = ()) -> torch.Tensor:
        """Prefill a prompt as the engine's scheduler does: reuse its cached prefix, allocate and
        compute the rest in block-aligned chunks of at most ``chunk`` tokens, each reserved just
        before it runs (the blocks before a chunk settle at its start); logits at absolute positions
        ``rows`` (each at or after the prefix hit)."""
        tokens = list(tokens)
        chunk = max(self.block_size, chunk // self.block_size * self.block_size)
        hit = self.bm.allocate_prompt(seq_id, tokens, end=lambda h: min(h + chunk, len(tokens))).num_cached_tokens
        if any(r < hit for r in rows):
            self.free(seq_id)
            raise ValueError(f"rows {list(rows)} fall in the cached prefix (first {hit} tokens)")
        out = []
        start = hit
        while start < len(tokens):
            end = min(start + chunk, len(tokens))
            ops = [] if start == hit else self.bm.append_slots(seq_id, tokens[start:end])
            mine = [r - start for r in rows if start <= r < end]
            lg = self._timed("prefill", end - start,
                             lambda: self._forward(seq_id, tokens[start:end], start, ops, mine))
            if mine:
                out.append(lg)
            start = end
        return torch.cat(out) if out else torch.empty(0)

    def greedy(self, parent, first_logits: torch.Tensor, n: int, child="greedy") -> list[int]:
        """Greedy continuation of ``n`` tokens after ``parent``'s last token, whose next-token logits are
        ``first_logits`` [V]; runs on a fork (shared blocks, copy-on-write), the parent is unchanged."""
        self.bm.fork(parent, child)
        try:
            out = [int(first_logits.argmax())]
            while len(out) < n:
                lg = self.append(child, [out[-1]], rows=[0], kind="decode")
                out.append(int(lg[0].argmax()))
        finally:
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
