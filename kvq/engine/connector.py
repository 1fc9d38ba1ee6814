"""KV connectors: the seam between the engine's KV cache and storage or peers outside the device.

A connector has two sides, as vLLM v1's ``KVConnectorBase_V1``:

* the scheduler side decides what to load or send and when: it is told of each request as it is
  added and finished, picks its copies out of each step's :class:`~kvq.engine.scheduling.SchedulerOutput`
  (the CPU prefix tier's ``host_ops``, a prefill peer's ``remote_ops``; the block manager and the
  scheduler, ``kvq.cache.block_loads`` and ``kvq.engine.scheduler_loads``, decide them) and reports
  each copy's end to the scheduler;
* the worker side (:meth:`KVConnector.issue`) starts those copies on its own stream or thread;
  :meth:`KVConnector.poll` finds their ends without a host sync.

The engine core (:class:`~kvq.engine.llm_engine.LLMEngine`) calls every connector it holds at fixed
points of its loop and knows nothing else of any::

    add_requests   add_request(seq, kv_transfer)  (a request about to run; kv_transfer: its parameters)
    step           poll()                         before the scheduler schedules: ends reported
                   schedule
                   before_forward(sched)          loads that need not wait for the step (a peer's fills)
                   forward, sampling
                   after_forward(sched)           copies ordered after the forward (the tier's)
                   sampled(seqs)                  before the sampled tokens are appended and finished
                                                  requests' blocks freed (a prefill engine's export)
                   update
                   end_step()                     copies the update decided (finished requests' blocks)
    idle           poll(wait=True)                when only a connector's work is left (has_pending)
    finished       request_finished(seq_id)
    metrics        stats()

Every hook but :meth:`~KVConnector.issue` has a default that does nothing, so a connector implements
what it uses: the CPU prefix tier (:mod:`kvq.connectors.cpu_prefix_tier`) ``after_forward``,
``end_step``, ``poll`` and ``stats``; a decode engine's prefill peer
(:mod:`kvq.connectors.remote_prefill`) ``loads_prompts``, ``before_forward``, ``poll``,
``has_pending`` and ``stats``; a prefill engine's export (:mod:`kvq.connectors.kv_export`)
``add_request``, ``sampled`` and ``request_finished``.  A disk tier would be a connector like the
CPU prefix tier; a second transfer backend implements the transport those two connectors drive
(``RemotePrefill``, ``KVExporter``), or these hooks itself.

Swap (``preemption_mode="swap"``) attaches through the same seam on the worker side only: its
scheduler side is the scheduler's preemption and the block manager's ``swap_out``/``swap_in``,
whose copies are cache ops of the step (``SchedulerOutput.ops``): they must run in order with the
step's seals and copy-on-writes (a block swapped out may be reused by a later op of the same step),
on every worker, before the forward reads, and end before it (the compute stream waits; nothing to
poll or report).  So every worker's runner hands the step's swap ops to a ``"swap"`` connector
(:mod:`kvq.connectors.swap`) in that order, and the engine loop does not call it.

Implementations live above the engine floor and are registered by name (:mod:`kvq.engine.registry`,
filled in kvq/__init__.py); they are built only through :func:`make_connector`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from kvq.engine.registry import CONNECTORS
from kvq.engine.sequence import Sequence


@dataclass(frozen=True)
class ConnectorContext:
    """What a connector may reach: the device pool and host pool (its worker side) and, on the engine's
    rank, the scheduler and block manager (its scheduler side; None on a worker that runs no engine)."""

    pool: object
    host_pool: object | None = None
    scheduler: object | None = None
    block_manager: object | None = None


@dataclass(frozen=True)
class ConnectorOutput:
    """A request a connector moved on outside the step (a peer's fill ended): the engine turns it into
    a :class:`~kvq.engine.outputs.RequestOutput`.  ``error``: why it failed (it is finished); else
    its first token is appended, with that token's ``logprobs`` row when the request asked for them."""

    seq: Sequence
    logprobs: dict | None = None
    error: str | None = None


class KVConnector:
    """One connector (module docstring).  ``name``: the name it is registered under."""

    name: str = ""
    #: every request's prompt is filled from outside (a decode engine's prefill peer): the scheduler
    #: reserves each whole prompt as LOADING and hands its load out in the step's ``remote_ops``
    loads_prompts: bool = False

    # -- requests (scheduler side) -------------------------------------------------------------
    def add_request(self, seq: Sequence, kv_transfer) -> bool:
        """A request just queued, with what it was added with for the connectors (``kv_transfer``,
        usually None); ValueError refuses it (the engine drops the whole batch).  -> whether this
        connector takes ``kv_transfer`` (the engine refuses one that no connector takes)."""
        return False

    def sampled(self, seqs: list[Sequence]) -> dict[int, object]:
        """Sequences whose next token the step sampled, before it is appended and the blocks of those
        that finish are freed (their KV is in the pool) -> {seq id: an object carried on that request's
        output as ``kv_transfer``}."""
        return {}

    def request_finished(self, seq_id: int) -> None:
        """A request finished or was aborted: forget it."""

    # -- the step (the scheduler side picks its copies, the worker side starts them) --------------
    def before_forward(self, sched) -> None:
        """The step is scheduled and its forward not enqueued yet."""

    def after_forward(self, sched) -> None:
        """The step's forward is enqueued (or the step has none)."""

    def end_step(self) -> None:
        """The step's updates are done (requests finished, blocks freed)."""

    def issue(self, ops) -> None:
        """Start copies the scheduler side decided."""
        raise NotImplementedError

    def poll(self, wait: bool = False) -> list[ConnectorOutput]:
        """Report copies that have ended to the scheduler, without a host sync; with ``wait`` (the
        engine has nothing else to do), block until some end first.  -> requests moved on."""
        return []

    def has_pending(self) -> bool:
        """Whether the engine must keep stepping for this connector's work alone."""
        return False

    def stats(self) -> dict:
        """Counters for the server's metrics."""
        return {}


def make_connector(name: str, ctx: ConnectorContext, **options) -> KVConnector:
    """The connector registered as ``name`` (kvq/__init__.py registers kvq's), built over ``ctx`` with
    its own ``options``."""
    target = CONNECTORS.get(name)
    if target is None:
        raise RuntimeError(f"no KV connector {name!r} is registered; registered: {', '.join(CONNECTORS) or 'none'}")
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)(ctx, **options)
