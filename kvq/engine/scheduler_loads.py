"""The scheduler's side of blocks filled from outside the device (:class:`~kvq.engine.scheduler.Scheduler`):
CPU-prefix-tier copies and a prefill peer's fills reported done, and LOADING sequences checked."""

from __future__ import annotations

from kvq.cache.block_manager import HostOp, RemoteLoadOp
from kvq.engine.sequence import SeqStatus, Sequence


class LoadsMixin:
    """State set up by Scheduler.__init__."""

    def host_copy_done(self, op: HostOp, ok: bool = True) -> bool:
        """A store or load of :attr:`SchedulerOutput.host_ops` has ended (``ok=False``: it failed, and
        is not running); a sequence it loaded for may run from the next :meth:`schedule`.  -> False
        for a load nobody waited for any more (:meth:`BlockManager.host_copy_done`)."""
        return self.block_manager.host_copy_done(op, ok)

    def remote_done(self, op: RemoteLoadOp, first_token: int | None, fallback: bool = True,
                    now: float | None = None) -> Sequence | None:
        """A fill of :attr:`SchedulerOutput.remote_ops` has ended; nothing writes its blocks any more.

        ``first_token``: the token the peer sampled after the prompt (the fill succeeded and was
        checked): the prompt counts as computed, the token is the first output and the sequence
        decodes from the next step (or finishes now, by EOS, a stop token or max_tokens).  ``None``:
        the fill failed; with ``fallback`` the sequence is requeued to be prefilled here, without
        the peer; without, it finishes with "abort".  -> the sequence, or None when it no longer
        waited for this fill (finished or preempted meanwhile; its blocks are released now)."""
        if not self.block_manager.remote_done(op, first_token is not None):
            return None
        seq = self._seqs[op.seq_id]
        assert seq.status is SeqStatus.LOADING and self._remote_loading[seq.seq_id] is op, seq
        del self._remote_loading[seq.seq_id], self._load_since[seq.seq_id]
        now = self._clock() if now is None else now
        if first_token is None:
            self.num_remote_failures += 1
            self._remote_wanted.discard(seq.seq_id)
            if fallback:
                self._requeue(seq)
            else:
                self._finish(seq, "abort", None)
            return seq
        n = op.num_tokens
        assert seq.num_tokens == n and seq.num_pending == 0 and not seq.output_token_ids, seq
        self._remote_wanted.discard(seq.seq_id)  # preempted later, it is recomputed here (it has outputs)
        seq.num_computed_tokens = seq.num_scheduled_tokens = n
        seq.status = SeqStatus.DECODE
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = now
        seq.append_token(int(first_token), now)
        stop = self._stop_condition(seq)
        if stop is not None:
            self._finish(seq, *stop)
        return seq

    def take_host_ops(self) -> list[HostOp]:
        """Tier stores decided outside :meth:`schedule` (requests freed by :meth:`update` or
        :meth:`finish`), to issue now rather than with the next step."""
        return self.block_manager.take_host_ops()

    def _check_load(self, seq: Sequence, now: float) -> None:
        """A LOADING sequence whose load has completed becomes PREFILL; one whose load failed or
        timed out goes back to WAITING, to be computed without the CPU prefix tier."""
        state = self.block_manager.load_state(seq.seq_id)
        if state is None:
            seq.status = SeqStatus.PREFILL
            del self._load_since[seq.seq_id]
        elif state == "failed" or now - self._load_since[seq.seq_id] > self.config.load_timeout_s:
            if state == "failed":
                self.num_load_failures += 1
            else:
                self.num_load_timeouts += 1
            self._no_host.add(seq.seq_id)
            self._requeue(seq, abandon_load=state == "loading")
