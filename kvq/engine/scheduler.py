"""The scheduler: which sequences run each step, how many tokens each, and who is preempted.

A tensor-free state machine over :class:`~kvq.engine.sequence.Sequence` objects
that drives a :class:`~kvq.cache.block_manager.BlockManager` (it must be the
manager's only user). One engine step::

    out = scheduler.schedule()          # decides; reserves KV slots; returns ops
    engine: run out.ops in order, then the forward over out.scheduled
            (tokens all_token_ids[start:start + num_new_tokens] of each), sample rows with sample=True
    finished = scheduler.update(out, {seq_id: token})   # an output with work must be updated before the next schedule
    engine: stop strings -> scheduler.finish(seq_id, "stop", matched)

Asynchronous scheduling (``max_inflight=2``): the engine schedules and launches
step N+1 *before* it update()s step N, so the host prepares a step while the
device runs the previous one.  A sequence whose step-N token is still unknown is
scheduled as a decode of that token: its slot is appended as
``PENDING_TOKEN`` (the block manager learns the id in update(N)), and the
forward reads the id from step N's sampler output on the device.  A sequence
that the pending token ends by length is not scheduled; one it ends by EOS, a
stop token or a stop string was, and update() skips that step's result for it.
Updates stay in schedule order; a sequence preempted with a token in flight
gets the token through update() before it can be re-admitted.

Policy of :meth:`Scheduler.schedule`, per step, with a token budget of
``max_num_batched_tokens``:

1. Decodes, oldest arrival first: each DECODE sequence gets one token (the
   one sampled last step; ``append_slots`` reserves its slot). If the cache
   cannot take it, the most recently arrived running sequence *newer than the
   one being served* is preempted by recompute (blocks freed, back to WAITING
   with ``num_computed_tokens = 0``), repeatedly; with no newer one left the
   sequence preempts itself. A sequence never displaces an older one.
2. Partially prefilled sequences (PREFILL), oldest first, get the next chunk
   of their prompt, reserved now by ``append_slots`` (a prompt is allocated
   chunk by chunk, so the blocks before a chunk are settled at its start and
   its first query reads its recent window exact, as a decode would; see
   :func:`~kvq.cache.window.exact_from`). If the cache cannot take the chunk,
   newer sequences are preempted as in 1, a decode already taken this step
   included (it leaves the step). A chunk that would be empty (no budget) stalls
   the phase and admission (a guard: under this policy a running prefill never
   gets less budget than its previous chunk, since what is left after a
   non-final chunk is too little to admit any sequence that would not finish
   its prompt in that step).
3. Admission, FCFS, only in a step that preempted nothing and did not stall a
   prefill: the head of the waiting queue is admitted while ``max_num_seqs``,
   the budget and ``can_allocate`` allow; ``allocate_prompt`` reserves its
   prefix hit and first chunk, and the hit becomes ``num_computed_tokens``.
   A head that does not fit blocks everything behind it (no starvation).

Chunks: ``min(remaining, budget)``, anywhere in a block, for every format: a
block is born quantized only when a chunk computes all of it (one the chunk
leaves partial stays hp and is sealed from hp later, :mod:`kvq.cache.block_manager`),
so formats sealed per block need no aligned chunks.  A chunk that does not
finish the prompt is not allowed without ``chunked_prefill``; the one that
reaches the end samples. Admission sizes the chunk as if there were no prefix
hit (a hit never empties it), so an admitted sequence runs in its admission
step. Both queues are kept in arrival order: a preempted sequence rejoins the
waiting queue ahead of later arrivals.

Liveness: :meth:`Scheduler.add` rejects a request that could not fit the
cache even alone (:func:`peak_blocks`, with chunks of at most
``max_num_batched_tokens``), so the oldest unfinished request can always
progress and every request finishes.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from kvq.cache.block_manager import PENDING_TOKEN, BlockManager, NoFreeBlocksError, Op, RemoteLoadOp
from kvq.cache.window import WindowPolicy, block_state, peak_blocks, rule_counts  # noqa: F401 (re-exported)
from kvq.engine.errors import RequestError
from kvq.engine.scheduler_checks import ChecksMixin
from kvq.engine.scheduler_loads import LoadsMixin
from kvq.engine.scheduler_swap import SwapFailuresMixin
from kvq.engine.scheduling import (PREEMPTION_MODES, ScheduledSeq, SchedulerConfig,  # noqa: F401 (re-exported)
                                   SchedulerOutput)
from kvq.engine.sequence import FINISH_REASONS, SeqStatus, Sequence


def _scores_prompt(seq: Sequence) -> bool:
    """Its prompt's logprobs are still to be computed (``prompt_logprobs``, no output yet): every
    position of the prompt runs here, none is taken from a prefix cache or a prefill peer.  Once a
    token is out, the whole prompt was scored (a preempted sequence recomputes without scoring)."""
    return seq.params.prompt_logprobs is not None and seq.num_output_tokens == 0


#: A scored prompt's chunk holds at most max(max_num_seqs, this) tokens: its logit rows ([rows, vocab]
#: float32) stay within a small multiple of the sampling rows the engine's memory profile measured.
SCORED_CHUNK_MIN = 256


def _prompt_rows(seq: Sequence, start: int, n: int) -> tuple[int, ...]:
    """Offsets among a chunk's ``n`` new tokens at ``start`` that score a prompt token: positions
    ``p < num_prompt_tokens - 1`` (the last prompt position's logits sample the first output)."""
    if not _scores_prompt(seq):
        return ()
    return tuple(range(max(0, min(start + n, seq.num_prompt_tokens - 1) - start)))


class Scheduler(LoadsMixin, ChecksMixin, SwapFailuresMixin):
    """Continuous batching with chunked prefill and preemption by recompute (policy: module docstring).

    ``eos_token_id``: one id or several; a sampled EOS finishes a request with
    "stop" unless its params say ``ignore_eos``. ``clock`` stamps scheduling and
    token times when :meth:`update` is not given ``now``.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 eos_token_id: int | Iterable[int] | None = None, clock: Callable[[], float] = time.monotonic):
        if config.block_size != block_manager.block_size:
            raise ValueError(f"config.block_size={config.block_size} differs from the block manager's "
                             f"{block_manager.block_size}")
        if len(block_manager):
            raise ValueError("the block manager already holds sequences; the scheduler must be its only user")
        self.config = config
        self.block_manager = block_manager
        eos = () if eos_token_id is None else (eos_token_id,) if isinstance(eos_token_id, int) else eos_token_id
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self._clock = clock
        self._seqs: dict[int, Sequence] = {}  # unfinished sequences
        self._rank: dict[int, int] = {}  # seq_id -> arrival order (add() calls)
        self._next_rank = 0
        self._waiting: list[Sequence] = []  # WAITING, in arrival order
        self._running: list[Sequence] = []  # PREFILL / DECODE, in arrival order
        self._inflight: list[tuple[SchedulerOutput, dict[int, Sequence]]] = []  # not yet update()d, oldest first
        self._released: list[int] = []  # sequences whose blocks were freed since the last schedule()
        self._swapped: list[Sequence] = []  # SWAPPED, in arrival order: resumed before any admission
        self._swapped_from: dict[int, SeqStatus] = {}  # PREFILL or DECODE, as they left
        self.num_swapped_out = self.num_swapped_in = self.num_swap_fallbacks = 0
        self.num_swap_failures = 0  # swap copies that failed: their sequences recomputed (swap_failed)
        self._load_since: dict[int, float] = {}  # LOADING sequences -> when they were admitted
        self._no_host: set[int] = set()  # sequences whose load failed or timed out: computed instead
        self.num_host_loads = self.num_load_failures = self.num_load_timeouts = 0
        self._remote_wanted: set[int] = set()  # sequences to prefill on a peer (add(remote=True))
        self._remote_loading: dict[int, RemoteLoadOp] = {}  # LOADING sequences waiting for a peer's fill
        self.num_remote_loads = self.num_remote_failures = 0
        self.num_demotions = 0  # blocks moved down a tier under pressure (elastic precision)

    # -- queries ----------------------------------------------------------------------------
    def get(self, seq_id: int) -> Sequence:
        """An unfinished sequence (KeyError for unknown or finished ids)."""
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"no unfinished sequence with id {seq_id!r}") from None

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_swapped(self) -> int:
        return len(self._swapped)

    @property
    def num_running(self) -> int:
        return len(self._running)

    # -- requests ---------------------------------------------------------------------------
    def add(self, seq: Sequence, remote: bool = False) -> None:
        """Queue a fresh sequence (WAITING, no outputs). Raises ValueError for a request that can never run.

        ``remote``: its prompt is prefilled by a peer server, which sends the KV and the first token:
        admitted as LOADING with its whole prompt reserved (:meth:`BlockManager.allocate_remote`,
        one :class:`RemoteLoadOp` in the step's ``remote_ops``), it decodes here once
        :meth:`remote_done` reports the fill.  (A request whose whole-prompt reservation could
        outgrow the cache is prefilled here instead.)"""
        if not isinstance(seq, Sequence):
            raise TypeError(f"add() takes a Sequence, got {type(seq).__name__}")
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence id {seq.seq_id!r} is already queued or running")
        if seq.status is not SeqStatus.WAITING or seq.output_token_ids or seq.num_computed_tokens:
            raise ValueError(f"add() takes a fresh sequence (WAITING, no outputs), got {seq!r}")
        p, cfg, m = seq.num_prompt_tokens, self.config, seq.params.max_tokens
        # the caller's terms only (RequestError.param names the field): no sequence ids or counters
        if p == 0:
            raise RequestError("the prompt is empty", "prompt")
        if p > cfg.max_model_len:
            raise RequestError(f"a prompt of {p} tokens exceeds max_model_len={cfg.max_model_len}", "prompt")
        if p + m > cfg.max_model_len:
            raise RequestError(f"the prompt ({p} tokens) + max_tokens ({m}) exceeds max_model_len="
                               f"{cfg.max_model_len}", "max_tokens")
        # The last output token is sampled but never cached: at most p + max_tokens - 1 tokens hold KV.
        q, hp = peak_blocks(p + m - 1, self.block_manager.policy, cfg.max_num_batched_tokens)
        nq, nhp = (self.block_manager.usable_blocks(pool) for pool in ("q", "hp"))
        if q > nq or hp > nhp:
            raise RequestError(f"the prompt ({p} tokens) + max_tokens ({m}) needs up to {q} q and {hp} hp KV "
                               f"blocks; the cache has {nq} q and {nhp} hp blocks", "max_tokens")
        self._seqs[seq.seq_id] = seq
        self._rank[seq.seq_id] = self._next_rank
        self._next_rank += 1
        self._insort(self._waiting, seq)
        # A fill reserves the whole prompt at once (its final layout: blocks a chunked prefill keeps hp
        # until its next call can be q already), so it is remote only where that always fits too;
        # otherwise it is prefilled here, which always fits (liveness, module docstring).
        # A request whose prompt is scored (prompt_logprobs) computes every position here.
        if remote and not _scores_prompt(seq) and all(
                a <= b for a, b in zip(peak_blocks(p + seq.params.max_tokens - 1, self.block_manager.policy),
                                       (nq, nhp))):
            self._remote_wanted.add(seq.seq_id)

    def finish(self, seq_id: int, reason: str, stop_reason: int | str | None = None) -> bool:
        """Finish an unfinished sequence now and free its blocks; False if there is none with that id.

        ``reason`` is one of "stop", "length", "abort". Safe between :meth:`schedule`
        and :meth:`update` (that update then skips it; the step's ops must still run).
        """
        if reason not in FINISH_REASONS:
            raise ValueError(f"unknown finish reason {reason!r}; valid: {', '.join(FINISH_REASONS)}")
        seq = self._seqs.get(seq_id)
        if seq is None:
            return False
        self._finish(seq, reason, stop_reason)
        return True

    def abort(self, seq_id: int) -> bool:
        """Finish with reason "abort" (see :meth:`finish`)."""
        return self.finish(seq_id, "abort")


    def discard_inflight(self) -> None:
        """Forget the steps :meth:`schedule` started when their forward failed and :meth:`update`
        will never come.  Every sequence of those steps must be finished first (e.g. aborted):
        their blocks are already free and whatever the steps half-wrote is never read."""
        live = [s.seq_id for out, seqs in self._inflight for s in out.scheduled if not seqs[s.seq_id].is_finished]
        if live:
            raise RuntimeError(f"sequences {live} of the in-flight step are still running: finish them first")
        self._inflight = []

    # -- the step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decide the next step (policy: module docstring). Empty output when nothing can run."""
        if len(self._inflight) >= self.config.max_inflight:
            raise RuntimeError(f"schedule() called with {len(self._inflight)} output(s) not yet update()d "
                               f"(max_inflight={self.config.max_inflight})")
        cfg, bm = self.config, self.block_manager
        bm.begin_step()
        now = self._clock()
        budget = cfg.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        ops: list[Op] = []
        preempted: list[int] = []

        def take(seq: Sequence, n: int, is_prefill: bool) -> None:
            nonlocal budget
            start, sid = seq.num_scheduled_tokens, seq.seq_id
            t0, refs, tlen = bm.table_delta(sid)
            sample = start + n == seq.num_tokens + seq.num_pending
            scored = _prompt_rows(seq, start, n) if seq.params.prompt_logprobs is not None else ()
            scheduled.append(ScheduledSeq(sid, n, start, is_prefill, sample, tuple(bm.slots(sid, start, start + n)),
                                          t0, refs, tlen, (n - 1,) if sample else (), scored))
            budget -= n
            seq.num_scheduled_tokens = start + n
            if sample:  # its next token is sampled by this step: a decode from now on
                seq.num_pending += 1
                seq.status = SeqStatus.DECODE
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now

        def untake(seq: Sequence) -> None:  # a sequence taken this step, then preempted by an older one
            nonlocal budget
            i = next(i for i, x in enumerate(scheduled) if x.seq_id == seq.seq_id)
            item = scheduled.pop(i)
            budget += item.num_new_tokens
            seq.num_pending -= item.sample

        def relieve(need: int) -> bool:
            """Elastic precision: the age policy's demotions already due, else the pressure policy's (demote
            cold blocks until ``need`` resident blocks are free; kvq.cache.block_tiers); the items already
            taken this step get their changed tables."""
            made = bm.age_due() if need > 0 else []
            if not made:
                made = bm.make_room(need) if need > 0 else []
                self.num_demotions += len(made)
            if not made:
                return False
            ops.extend(made)
            touched = {op.seq_id for op in made}
            for j, item in enumerate(scheduled):
                if item.seq_id in touched:  # its delta was taken: merge the entries demotion changed
                    start = min(item.table_start, bm.table_delta(item.seq_id)[0])
                    table = bm.block_table(item.seq_id)
                    scheduled[j] = replace(item, table_start=start, table_refs=tuple(table[start:]),
                                           table_len=len(table))
            return True

        def grow(seq: Sequence, tokens: list[int], decode: bool) -> bool:
            """Reserve ``tokens`` for ``seq``, demoting cold blocks (elastic precision) or else preempting
            newer sequences (then itself) until they fit.  A prompt's chunk ages none of its blocks: the
            age policy starts at its first decode, so a prompt's logits do not depend on its chunks (nor
            on the batch that cut them); only a step short of memory ages a prompt (``relieve``)."""
            while True:  # append_slots plans once and raises, the manager unchanged, when it cannot
                try:
                    ops.extend(bm.append_slots(seq.seq_id, tokens, age=decode))
                    return True
                except NoFreeBlocksError:
                    need_q, need_hp = bm.append_need(seq.seq_id, len(tokens))
                    if need_hp <= bm.num_free_blocks("hp") and relieve(need_q):
                        continue
                    victim = self._running[-1]  # the newest; `seq` itself when no newer one is left
                    taken = any(x.seq_id == victim.seq_id for x in scheduled)
                    if taken:
                        untake(victim)
                    # a victim taken this step has a slot reserved for work it will not do: recompute
                    self._preempt(victim, ops, swap=not taken)
                    preempted.append(victim.seq_id)
                    if victim is seq:
                        return False

        for seq in list(self._running):  # 0. loads from the CPU prefix tier that have ended
            if seq.status is SeqStatus.LOADING and seq.seq_id not in self._remote_loading:
                self._check_load(seq, now)

        for seq in list(self._running):  # 1. decodes
            if seq.status is not SeqStatus.DECODE:  # PREFILL, or preempted by an older decode
                continue
            if self._finishes_when_known(seq):
                continue
            assert budget >= 1, "max_num_batched_tokens >= max_num_seqs leaves every decode a token"
            token = seq.last_token_id if seq.num_pending == 0 else PENDING_TOKEN
            if grow(seq, [token], decode=True):
                take(seq, 1, is_prefill=False)

        stalled = False
        for seq in list(self._running):  # 2. prompt chunks of running sequences (allocated chunk by chunk)
            if seq.status is not SeqStatus.PREFILL:  # DECODE, or preempted just now
                continue
            start = seq.num_scheduled_tokens
            reserved = bm.num_tokens(seq.seq_id) - start
            if reserved:  # a loaded prompt's first chunk, reserved when it was admitted
                if reserved > budget:
                    stalled = True
                    break
                take(seq, reserved, is_prefill=True)
                continue
            n = self._chunk(start, seq.num_tokens, self._budget(seq, budget))
            if n == 0:
                stalled = True
                break
            if grow(seq, seq.all_token_ids[start:start + n], decode=False):
                take(seq, n, is_prefill=True)

        while not preempted and not stalled and self._swapped and len(self._running) < cfg.max_num_seqs:  # 3a.
            seq = self._swapped[0]
            # a loaded prompt swapped out before its reserved first chunk ran resumes with that chunk
            reserved = bm.num_tokens(seq.seq_id) - seq.num_scheduled_tokens
            n = 1 if self._swapped_from[seq.seq_id] is SeqStatus.DECODE else \
                reserved or self._chunk(seq.num_scheduled_tokens, seq.num_tokens, self._budget(seq, budget))
            if n == 0 or budget < n:
                break  # the head waits; nothing is admitted behind it
            try:  # all or nothing (a tiered arena's room is known only by taking the blocks)
                ops.append(bm.swap_in(seq.seq_id))
            except NoFreeBlocksError:
                break
            self._swapped.pop(0)
            seq.status = self._swapped_from.pop(seq.seq_id)
            self._insort(self._running, seq)
            self.num_swapped_in += 1
            if seq.status is SeqStatus.DECODE:
                if self._finishes_when_known(seq):
                    continue
                token = seq.last_token_id if seq.num_pending == 0 else PENDING_TOKEN
                if grow(seq, [token], decode=True):
                    take(seq, 1, is_prefill=False)
            elif reserved:
                take(seq, n, is_prefill=True)
            else:
                start = seq.num_scheduled_tokens
                if grow(seq, seq.all_token_ids[start:start + n], decode=False):
                    take(seq, n, is_prefill=True)

        remote_ops: list[RemoteLoadOp] = []
        while (not preempted and not stalled and not self._swapped and self._waiting
               and len(self._running) < cfg.max_num_seqs):  # 3b.
            seq = self._waiting[0]
            tokens = seq.all_token_ids
            if seq.seq_id in self._remote_wanted:  # prefilled by a peer: no compute here, no budget
                if not bm.can_allocate_remote(len(tokens)):
                    break
                op = bm.allocate_remote(seq.seq_id, tokens)
                self._waiting.pop(0)
                self._insort(self._running, seq)
                seq.status = SeqStatus.LOADING
                self._load_since[seq.seq_id] = now
                self._remote_loading[seq.seq_id] = op
                remote_ops.append(op)
                self.num_remote_loads += 1
                continue
            if self._chunk(0, len(tokens), self._budget(seq, budget)) == 0:
                break
            def first_chunk_end(hit: int, n=len(tokens), b=self._budget(seq, budget)) -> int:  # a hit shortens it
                return hit + self._chunk(hit, n, b)

            use_host, cached = seq.seq_id not in self._no_host, not _scores_prompt(seq)  # scored: no hit
            args = (len(tokens), tokens if cached else None)
            if not bm.can_allocate(*args, end=first_chunk_end, use_host=use_host):
                # elastic precision: demote cold blocks of running sequences to admit it, if they can
                first = first_chunk_end(0)
                if not (relieve(-(-first // bm.block_size)) and bm.can_allocate(*args, end=first_chunk_end,
                                                                                use_host=use_host)):
                    break
            assert seq.num_pending == 0, "a sequence re-admitted before its in-flight token arrived"
            try:
                hit = bm.allocate_prompt(seq.seq_id, tokens, end=first_chunk_end, use_host=use_host,
                                         use_cache=cached)
            except NoFreeBlocksError:  # a load into several tiers the allocators' order defeated: it waits
                break
            self._waiting.pop(0)
            seq.num_computed_tokens = seq.num_scheduled_tokens = hit.num_cached_tokens
            self._insort(self._running, seq)
            if hit.num_loading_tokens:  # it runs once its prefix has loaded; the others go on meanwhile
                seq.status = SeqStatus.LOADING
                self._load_since[seq.seq_id] = now
                self.num_host_loads += 1
                # its first chunk counts against this step's budget as if it ran, so a step admits no
                # more than it would without the tier (more would only crowd the pool and preempt)
                budget -= bm.num_tokens(seq.seq_id) - hit.num_cached_tokens
                continue
            seq.status = SeqStatus.PREFILL
            take(seq, bm.num_tokens(seq.seq_id) - hit.num_cached_tokens, is_prefill=True)

        released = tuple(dict.fromkeys(self._released))  # a sequence preempted, rescheduled and finished: once
        self._released.clear()
        out = SchedulerOutput(tuple(scheduled), tuple(ops), tuple(preempted), sum(s.num_new_tokens for s in scheduled),
                              released, tuple(bm.take_host_ops()), tuple(remote_ops), bm.take_wipes())
        self._check_output(out)
        if scheduled:
            self._inflight.append((out, {s.seq_id: self._seqs[s.seq_id] for s in scheduled}))
        return out

    def update(self, output: SchedulerOutput, sampled: dict[int, int], now: float | None = None) -> list[Sequence]:
        """Apply a step's results; return the sequences it finished (their blocks are freed).

        ``sampled`` maps each scheduled ``sample=True`` sequence to its new token
        (other keys are ignored). Finishes on EOS (unless ``ignore_eos``), a stop
        token id, ``max_tokens`` or ``max_model_len``; stop strings are the
        engine's (:meth:`finish`). Sequences finished since :meth:`schedule` are skipped.
        """
        if not output.scheduled:
            return []
        if not self._inflight or output is not self._inflight[0][0]:
            raise ValueError("update() takes the oldest output of schedule() not yet update()d, once")
        seqs = self._inflight[0][1]
        live = [s for s in output.scheduled if not seqs[s.seq_id].is_finished]
        missing = [s.seq_id for s in live if s.sample and s.seq_id not in sampled]
        if missing:
            raise ValueError(f"no sampled token for sequences {missing} (scheduled with sample=True)")
        now = self._clock() if now is None else now
        self._inflight.pop(0)
        bm = self.block_manager
        finished: list[Sequence] = []
        for s in live:
            seq = seqs[s.seq_id]
            end = s.start + s.num_new_tokens
            held = seq.is_running or seq.status is SeqStatus.SWAPPED  # its KV was not dropped since
            if held:  # (a swap-out runs after this step's forward: the host copy holds its KV)
                assert seq.num_computed_tokens == s.start and seq.num_scheduled_tokens >= end, (seq, s)
                seq.num_computed_tokens = end
                bm.mark_computed(seq.seq_id, end)
            if not s.sample:
                continue
            assert end == seq.num_tokens and seq.num_pending >= 1, (seq, s)
            seq.num_pending -= 1
            token = int(sampled[s.seq_id])
            if held and bm.num_tokens(seq.seq_id) > end:  # a later step already took its slot
                bm.set_token(seq.seq_id, end, token)
            seq.append_token(token, now)
            stop = self._stop_condition(seq)
            if stop is not None:
                self._finish(seq, *stop)
                finished.append(seq)
        return finished

    # -- internals --------------------------------------------------------------------------
    def _insort(self, queue: list[Sequence], seq: Sequence) -> None:
        bisect.insort(queue, seq, key=lambda s: self._rank[s.seq_id])

    def _budget(self, seq: Sequence, budget: int) -> int:
        """``budget`` for one sequence's chunk: a scored prompt's chunks are capped (SCORED_CHUNK_MIN)."""
        return min(budget, max(self.config.max_num_seqs, SCORED_CHUNK_MIN)) if _scores_prompt(seq) else budget

    def _chunk(self, start: int, end: int, budget: int) -> int:
        """Tokens of ``[start, end)`` to compute this step under ``budget``; 0 if none may run."""
        n = min(end - start, budget)
        if n < end - start:  # not the prompt's last chunk
            if not self.config.chunked_prefill:
                return 0
        return max(n, 0)

    def _finishes_when_known(self, seq: Sequence) -> bool:
        """Its in-flight token ends it by length (max_tokens, max_model_len): not worth a step."""
        if seq.num_pending == 0:
            return False
        return (seq.num_output_tokens + seq.num_pending >= seq.params.max_tokens
                or seq.num_tokens + seq.num_pending >= self.config.max_model_len)

    def _preempt(self, seq: Sequence, ops: list | None = None, swap: bool = True) -> None:
        """Preempt a running sequence.  With ``preemption_mode="swap"`` (and ``swap``) its KV goes to
        the host tier (a swap-out op appended to ``ops``) and it waits in SWAPPED, state kept,
        to resume before any admission; when the tier cannot hold it (or without swap) it is
        preempted by recompute: drop the KV, keep every token (an in-flight one still arrives
        through :meth:`update`), requeue in arrival order."""
        bm = self.block_manager
        if seq.status is SeqStatus.LOADING:  # nothing computed yet: give its blocks back
            self._requeue(seq)
            seq.num_preemptions += 1
            return
        if swap and ops is not None and self.config.preemption_mode == "swap":
            if bm.can_swap_out(seq.seq_id):
                ops.append(bm.swap_out(seq.seq_id))
                self._released.append(seq.seq_id)
                self._running.remove(seq)
                self._swapped_from[seq.seq_id] = seq.status
                seq.status = SeqStatus.SWAPPED
                seq.num_preemptions += 1
                self.num_swapped_out += 1
                self._insort(self._swapped, seq)
                return
            self.num_swap_fallbacks += 1
        self._requeue(seq)
        seq.num_preemptions += 1

    def _requeue(self, seq: Sequence, abandon_load: bool = False, drop: bool = False) -> None:
        """Drop a running sequence's KV (computed full blocks stay in the prefix caches, unless ``drop``:
        its blocks hold none) and put it back in the waiting queue, in arrival order, every token kept."""
        if abandon_load:
            self.block_manager.abandon_load(seq.seq_id)
        elif drop:
            self.block_manager.drop(seq.seq_id)
        else:
            self.block_manager.free(seq.seq_id)
        self._released.append(seq.seq_id)
        self._running.remove(seq)
        self._load_since.pop(seq.seq_id, None)
        self._remote_loading.pop(seq.seq_id, None)
        seq.status = SeqStatus.WAITING
        seq.num_computed_tokens = seq.num_scheduled_tokens = 0
        self._insort(self._waiting, seq)


    def _stop_condition(self, seq: Sequence) -> tuple[str, int | None] | None:
        """(finish_reason, stop_reason) after a new token, or None to continue; stop tokens win over length."""
        tok, p = seq.output_token_ids[-1], seq.params
        if tok in self.eos_token_ids and not p.ignore_eos:
            return "stop", None
        if tok in p.stop_token_ids:
            return "stop", tok
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length", None
        return None

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        bm = self.block_manager
        if seq.seq_id in bm:
            bm.free(seq.seq_id)
            self._released.append(seq.seq_id)
        elif bm.is_swapped(seq.seq_id):
            bm.free(seq.seq_id)  # its host blocks
        if seq.status is SeqStatus.SWAPPED:
            self._swapped.remove(seq)
            del self._swapped_from[seq.seq_id]
        else:
            (self._running if seq.is_running else self._waiting).remove(seq)
        self._load_since.pop(seq.seq_id, None)
        self._remote_loading.pop(seq.seq_id, None)
        self._remote_wanted.discard(seq.seq_id)
        self._no_host.discard(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason  # type: ignore[assignment]
        seq.stop_reason = stop_reason
        del self._seqs[seq.seq_id], self._rank[seq.seq_id]
