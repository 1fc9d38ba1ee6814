"""What the scheduler obeys and what it hands out: its config, and the step -- one data object
(:class:`SchedulerOutput`, one :class:`ScheduledSeq` per sequence) from the scheduler to the runner."""

from __future__ import annotations

from dataclasses import dataclass

from kvq.cache.block_manager import BlockRef, HostOp, Op, RemoteLoadOp
from kvq.cache.window import WindowPolicy

PREEMPTION_MODES = ("recompute", "swap")

@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Budgets and shapes the scheduler obeys (keyword-only).

    max_num_seqs            running sequences at most (and sequences per step)
    max_num_batched_tokens  tokens computed per step, prefill chunks and decodes together
    max_model_len           prompt + output tokens per request at most
    block_size              tokens per KV block; must equal the block manager's
    chunked_prefill         split prompts over steps; without it a prompt runs in one step
    max_inflight            scheduled outputs not yet update()d: 1 (schedule after each update),
                            or 2: asynchronous scheduling, step N+1 decided while step N runs
    preemption_mode         "recompute" (drop the KV, prefill again) or "swap" (park it in the
                            block manager's host tier; recompute when the tier is full)
    load_timeout_s          how long a LOADING sequence waits for its prefix to load from the CPU
                            prefix tier before it is computed instead
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int
    block_size: int
    chunked_prefill: bool = True
    max_inflight: int = 1
    preemption_mode: str = "recompute"
    load_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.load_timeout_s, int | float) or not self.load_timeout_s > 0:
            raise ValueError(f"SchedulerConfig.load_timeout_s must be a number > 0, got {self.load_timeout_s!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"unknown preemption_mode {self.preemption_mode!r}; valid: {', '.join(PREEMPTION_MODES)}")
        if self.max_inflight not in (1, 2):
            raise ValueError(f"SchedulerConfig.max_inflight must be 1 (synchronous) or 2 (asynchronous scheduling), "
                             f"got {self.max_inflight!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"SchedulerConfig.{name} must be an int >= 1, got {v!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_num_seqs="
                             f"{self.max_num_seqs}, so that every running sequence can decode each step")
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"without chunked_prefill a prompt runs in one step: max_num_batched_tokens="
                             f"{self.max_num_batched_tokens} must be >= max_model_len={self.max_model_len}")

    @classmethod
    def from_policy(cls, policy: WindowPolicy, **kw) -> SchedulerConfig:
        """A config whose block size comes from the cache's window policy."""
        return cls(block_size=policy.block_size, **kw)


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's work in a step: compute KV of positions ``[start, start + num_new_tokens)``.

    It carries what the runner needs from the block manager, so nobody else reads
    the manager: the cache slot of each new token, and the block-table entries
    ``[table_start, table_len)`` that changed since the sequence was last
    scheduled (its whole table the first time, and after a preemption).
    """

    seq_id: int
    num_new_tokens: int
    start: int
    is_prefill: bool
    sample: bool  # this step yields its next token (decodes; the prefill chunk that ends the prompt)
    slots: tuple[tuple[str, int, int], ...] = ()  # (pool, block, offset) of each new token
    table_start: int = 0
    table_refs: tuple[BlockRef, ...] = ()  # the table's entries [table_start, table_len)
    table_len: int = 0
    logit_rows: tuple[int, ...] = ()  # offsets among the new tokens whose logits the step returns
    # offsets among the new tokens whose logits score the prompt's next token (prompt_logprobs):
    # position start + off is scored against the prompt token at start + off + 1; returned after
    # every item's logit_rows (kvq.engine.prompt_logprobs)
    prompt_rows: tuple[int, ...] = ()


@dataclass(frozen=True)
class SchedulerOutput:
    """A step's decisions. Run ``ops`` in order before the forward writes any KV (block manager contract)."""

    scheduled: tuple[ScheduledSeq, ...] = ()
    ops: tuple[Op, ...] = ()
    preempted: tuple[int, ...] = ()
    num_batched_tokens: int = 0
    released: tuple[int, ...] = ()  # sequences whose blocks were freed since the previous output
    # stores and loads of the CPU prefix tier: issue them after the step's forward is enqueued (they
    # touch no block the step reads or writes) and report each end with Scheduler.host_copy_done
    host_ops: tuple[HostOp, ...] = ()
    # prompts admitted to be filled by a prefill peer: start each fill, report its end with
    # Scheduler.remote_done
    remote_ops: tuple[RemoteLoadOp, ...] = ()
    # slabs of a tiered arena that changed hands between tiers: zero them (WipeOp) before anything of the
    # step, the connectors' copies included, reads or writes the cache (kvq.cache.arena)
    wipes: tuple[int, ...] = ()
