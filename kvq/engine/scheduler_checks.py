"""The scheduler's invariants, checked (kvq.engine.scheduler: every output as it is made, the whole
state in tests and debugging)."""

from __future__ import annotations

from kvq.cache.block_manager import PENDING_TOKEN
from kvq.engine.scheduling import SchedulerOutput
from kvq.engine.sequence import SeqStatus


class ChecksMixin:
    """``_check_output`` and ``check_integrity`` of :class:`~kvq.engine.scheduler.Scheduler`."""

    def _check_output(self, out: SchedulerOutput) -> None:
        cfg = self.config
        ids = [s.seq_id for s in out.scheduled]
        assert len(ids) == len(set(ids)), f"a sequence scheduled twice: {ids}"
        assert len(ids) <= cfg.max_num_seqs, (len(ids), cfg.max_num_seqs)
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens, (out.num_batched_tokens, cfg)
        assert not set(ids) & set(out.preempted), "a preempted sequence was scheduled"
        assert all(s.num_new_tokens >= 1 for s in out.scheduled)

    def check_integrity(self) -> None:
        """Assert the queues, statuses and block manager agree (see the module docstring)."""
        bm, cfg = self.block_manager, self.config
        assert len(self._running) <= cfg.max_num_seqs
        queues = (self._waiting, self._running, self._swapped)
        assert set(self._seqs) == {s.seq_id for q in queues for s in q}
        assert len(self._seqs) == sum(map(len, queues)), "a sequence queued twice"
        assert len(bm) == len(self._running), "the block manager holds sequences the scheduler does not run"
        assert bm.num_swapped == len(self._swapped) == len(self._swapped_from), "swapped sequences disagree"
        assert self._remote_loading.keys() <= self._remote_wanted <= self._seqs.keys(), "remote fills disagree"
        for seq in self._swapped:
            assert seq.status is SeqStatus.SWAPPED and bm.is_swapped(seq.seq_id), seq
            assert self._swapped_from[seq.seq_id] in (SeqStatus.PREFILL, SeqStatus.DECODE), seq
        for queue in queues:
            ranks = [self._rank[s.seq_id] for s in queue]
            assert ranks == sorted(ranks), "queues must stay in arrival order"
        for seq in self._waiting:
            assert seq.status is SeqStatus.WAITING and seq.num_computed_tokens == 0, seq
            assert seq.seq_id not in bm, seq
        for seq in self._running:
            sid, n = seq.seq_id, seq.num_tokens
            assert seq.is_running and sid in bm, seq
            assert n < cfg.max_model_len and seq.num_output_tokens < seq.params.max_tokens, seq
            assert (seq.status is SeqStatus.LOADING) == (sid in self._load_since), seq
            if sid in self._remote_loading:  # its whole prompt is reserved; a peer fills it
                assert seq.status is SeqStatus.LOADING and bm.remote_state(sid) == "loading", seq
                assert seq.num_computed_tokens == 0 and bm.num_tokens(sid) == n and not seq.output_token_ids, seq
            if seq.status is SeqStatus.LOADING:  # its hit counts as scheduled; the device part is computed
                assert seq.num_pending == 0 and seq.num_computed_tokens == seq.num_scheduled_tokens, seq
                assert bm.num_computed(sid) <= seq.num_computed_tokens < bm.num_tokens(sid) <= n, seq
                continue
            assert seq.num_computed_tokens <= seq.num_scheduled_tokens, seq
            assert seq.num_computed_tokens <= bm.num_computed(sid) <= seq.num_scheduled_tokens, seq
            assert 0 <= seq.num_pending <= cfg.max_inflight, seq
            if seq.status is SeqStatus.PREFILL:
                assert seq.num_pending == 0 and 0 <= seq.num_scheduled_tokens < n, seq
                # reserved chunk by chunk (a loaded prompt's first chunk is reserved before it runs)
                assert seq.num_scheduled_tokens <= bm.num_tokens(sid) <= n, seq
            else:
                assert seq.num_scheduled_tokens == n + seq.num_pending - 1 == bm.num_tokens(sid), seq
            known = min(bm.num_tokens(sid), n)  # slots past the known tokens hold in-flight ones
            ids = list(bm.token_ids(sid))
            assert ids[:known] == seq.all_token_ids[:known] and all(t == PENDING_TOKEN for t in ids[known:]), seq
        for out, _ in self._inflight:
            self._check_output(out)
