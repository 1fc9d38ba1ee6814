"""The engine on its own thread, fed by an asyncio front end.

``LLMEngine`` is not thread-safe, so exactly one thread (the *engine thread*)
ever touches it.  Everything else talks to that thread through one command
queue and hears back through per-request asyncio queues::

    HTTP handler (event loop)                     engine thread
    -------------------------                     -------------
    (prompts tokenized on a worker thread first: kvq/server/admission.py)
    submit(token ids, params) --_Add------------>  engine.add_request
        <- future: engine ids, or the ValueError   (all of a group's prompts, or none of them)
    async for (index, output) in group  <-------  engine.step() -> call_soon_threadsafe(queue.put_nowait)
    client gone: abort(group) --_Abort---------->  engine.abort(ids): blocks freed before the next step
    check() --_Check---------------------------->  block manager + scheduler integrity, leaked blocks
    shutdown: abort_all() --_AbortAll----------->  engine.abort(every live id); each stream: ShuttingDown

The loop never dies because of one request: bad input is that request's
ValueError (HTTP 400).  If ``step()`` itself raises, the batch it was running
is unknown, so every live request fails with :class:`EngineError`, the
scheduler's in-flight step is discarded and integrity is checked; only when
that recovery fails is the engine marked dead (HTTP 503 from then on).

Admission is bounded: at most ``max_num_seqs + max_queue_len`` engine requests
are live at once; one more is :class:`OverloadedError` (HTTP 429) at once,
rather than a queue that grows without limit.

Shutdown (kvq/server/launch.py drives it): :meth:`AsyncEngine.begin_drain` refuses every new
request (:class:`ShuttingDown`, HTTP 503) while live ones go on; :meth:`AsyncEngine.abort_all`
ends those still live at the drain's deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from kvq.engine.errors import request_error
from kvq.engine.llm_engine import LLMEngine
from kvq.engine.outputs import RequestOutput
from kvq.engine.sampling_params import SamplingParams
from kvq.server.metrics import EngineEvents

IDLE_WAIT_S = 0.05  # how long the idle engine thread blocks on the command queue


class OverloadedError(RuntimeError):
    """Too many live requests: the client should retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine thread is not running (stopped, or failed beyond recovery): HTTP 503."""


class EngineError(RuntimeError):
    """The engine failed while running this request (HTTP 500); the engine itself recovered."""


class ShuttingDown(EngineDeadError):
    """The server is shutting down: a new request is refused, or a running one was ended by the drain's
    deadline (HTTP 503 with Retry-After; a stream ends with finish_reason "abort")."""


@dataclass(frozen=True)
class PromptSpec:
    """One engine request: its prompt's token ids (tokenized before it reaches the engine thread)
    and SamplingParams keywords (``max_tokens`` resolved)."""

    sampling: dict
    token_ids: list[int]
    export_to: object = None  # a prefill server's export of the KV (LLMEngine.add_requests' kv_transfer)
    label: str | None = None  # which prompt of the request, for its errors ("prompt[2]"), or None


@dataclass
class RequestGroup:
    """The engine requests of one HTTP request (prompts x n), and where their outputs go."""

    specs: list[PromptSpec]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # (index, RequestOutput | Exception)
    engine_ids: list[int] = field(default_factory=list)  # set by the engine thread
    prompt_token_ids: list[list[int]] = field(default_factory=list)
    done: set[int] = field(default_factory=set)  # indices finished (front-end side)
    released: bool = False

    def __len__(self) -> int:
        return len(self.specs)


@dataclass
class _Add:
    group: RequestGroup
    reply: concurrent.futures.Future


@dataclass
class _Abort:
    group: RequestGroup


@dataclass
class _AbortAll:
    reason: str


@dataclass
class _Check:
    reply: concurrent.futures.Future


@dataclass
class _Live:
    group: RequestGroup
    index: int
    arrival: float
    seen: dict = field(default_factory=lambda: {"tokens": 0, "itl": 0, "preemptions": 0})


class AsyncEngine:
    """Owns an :class:`LLMEngine` on a thread; ``submit``/``stream``/``abort`` from an event loop."""

    def __init__(self, engine: LLMEngine, *, max_queue_len: int = 256, events: EngineEvents | None = None):
        if max_queue_len < 0:
            raise ValueError(f"max_queue_len must be >= 0, got {max_queue_len}")
        self.engine = engine
        self.max_live = engine.config.max_num_seqs + max_queue_len
        self.events = events or EngineEvents(None)
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, _Live] = {}  # engine request id -> its group (engine thread only)
        self._num_live = 0  # engine requests admitted and not yet released (event-loop side)
        self._draining = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.dead_reason: str | None = None
        self.num_steps = 0
        self.num_recoveries = 0
        self.snapshot: dict = self._snapshot()  # replaced (never mutated) by the engine thread

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine thread was already started")
        self._thread = threading.Thread(target=self._run, name="kvq-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_reason is None \
            and not self._stop.is_set()

    # -- shutdown (kvq.server.launch.Server drives it) --------------------------------------------
    def begin_drain(self) -> None:
        """From now on every new request is refused with :class:`ShuttingDown`; live ones go on."""
        self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def num_live(self) -> int:
        """Engine requests admitted and not yet released by the front end (event-loop side)."""
        return self._num_live

    def abort_all(self, reason: str) -> None:
        """End every live request on the engine thread (its blocks freed before the next step); each
        unfinished output stream raises ``ShuttingDown(reason)``.  Call :meth:`begin_drain` first, so
        that nothing is admitted behind it."""
        self._cmds.put(_AbortAll(reason))

    # -- front end (event loop) -----------------------------------------------------------------
    def check_room(self, count: int) -> None:
        """Raise EngineDeadError, ValueError (more than could ever be admitted) or OverloadedError unless
        ``count`` more engine requests can be admitted now.  Cheap, and it only reads, so any thread may
        call it before building work (the admission worker does); ``submit`` checks again on the loop."""
        if self._draining:
            raise ShuttingDown("the server is shutting down and takes no new requests; retry on another replica")
        if not self.alive:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        if count > self.max_live:
            raise ValueError(f"this request asks for {count} sequences (prompts x n); the server admits at "
                             f"most {self.max_live} at once")
        if self._num_live + count > self.max_live:
            raise OverloadedError(f"server overloaded: {self._num_live} sequences running or queued, limit "
                                  f"{self.max_live} (--max-num-seqs + --max-queue-len); retry later")

    async def submit(self, specs: list[PromptSpec]) -> RequestGroup:
        """Admit a group of engine requests; raises OverloadedError, EngineDeadError or ValueError (bad input)."""
        self.check_room(len(specs))
        group = RequestGroup(specs, asyncio.get_running_loop())
        self._num_live += len(specs)
        try:
            reply: concurrent.futures.Future = concurrent.futures.Future()
            self._cmds.put(_Add(group, reply))
            await asyncio.wrap_future(reply)
        except BaseException:
            self._num_live -= len(specs)
            self._cmds.put(_Abort(group))  # a cancelled add may still land: take it back
            raise
        return group

    async def outputs(self, group: RequestGroup) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of the group's requests as they come, until all have finished.

        Raises EngineError (or EngineDeadError) if the engine failed under them.
        """
        while len(group.done) < len(group):
            index, item = await group.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                group.done.add(index)
            yield index, item

    def release(self, group: RequestGroup) -> None:
        """The front end is done with the group: abort what is unfinished and free its slots (idempotent)."""
        if group.released:
            return
        group.released = True
        self._num_live -= len(group)
        if len(group.done) < len(group):
            self._cmds.put(_Abort(group))

    async def check(self) -> dict:
        """Integrity of the block manager and scheduler, and used blocks, checked on the engine thread."""
        if not self.alive:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        reply: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(_Check(reply))
        return await asyncio.wrap_future(reply)

    def check_sync(self, timeout: float = 30.0) -> dict:
        """:meth:`check` for a thread that is not the event loop (tests)."""
        reply: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(_Check(reply))
        return reply.result(timeout)

    # -- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        dev = self.engine.device
        if dev.type == "cuda" and dev.index is not None:
            torch.cuda.set_device(dev)  # the current device is per thread
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    self._step()
                self.snapshot = self._snapshot()
        except BaseException as e:  # noqa: BLE001 - a bug in this loop itself: report it, fail everyone
            self.dead_reason = f"engine loop crashed: {type(e).__name__}: {e}"
            traceback.print_exc()
        finally:
            reason = self.dead_reason or "the server is shutting down"
            ended = EngineDeadError(reason) if self.dead_reason else ShuttingDown(reason)  # stopped: as a drain's end
            for live in list(self._live.values()):
                self._push(live.group, live.index, ended)
            self._live.clear()
            self._fail_pending(reason)
            self.snapshot = self._snapshot()

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=IDLE_WAIT_S) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd) -> None:
        if isinstance(cmd, _Add):
            self._add(cmd)
        elif isinstance(cmd, _Abort):
            for rid in cmd.group.engine_ids:
                if rid in self._live:
                    del self._live[rid]
                    self.engine.abort(rid)
                    self.events.finished("abort")
        elif isinstance(cmd, _AbortAll):
            err = ShuttingDown(cmd.reason)
            for rid, live in list(self._live.items()):
                self.engine.abort(rid)
                self.events.finished("abort")
                self._push(live.group, live.index, err)
            self._live.clear()
        elif isinstance(cmd, _Check):
            if not cmd.reply.set_running_or_notify_cancel():
                return
            try:
                cmd.reply.set_result(self._integrity())
            except Exception as e:  # noqa: BLE001 - handed to the caller
                cmd.reply.set_exception(e)

    def _add(self, cmd: _Add) -> None:
        if not cmd.reply.set_running_or_notify_cancel():
            return
        group, added = cmd.group, []
        try:
            for index, spec in enumerate(group.specs):
                try:
                    rid = self.engine.add_request(spec.token_ids, SamplingParams(**spec.sampling),
                                                  kv_transfer=spec.export_to)
                except ValueError as e:  # in the client's terms: the field, and which prompt of the request
                    raise request_error(e, spec.label) from None
                added.append(rid)
                group.prompt_token_ids.append(spec.token_ids)
                self._live[rid] = _Live(group, index, time.monotonic())
        except Exception as e:  # noqa: BLE001 - bad input (any kind): no part of the group stays in the engine
            for rid in added:
                self._live.pop(rid, None)
                self.engine.abort(rid)
            cmd.reply.set_exception(e if isinstance(e, ValueError) else ValueError(f"{type(e).__name__}: {e}"))
            return
        group.engine_ids = added
        cmd.reply.set_result(added)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - one failed step must not end the loop
            self._recover(e)
            return
        self.num_steps += 1
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            self.events.observe(out, live.seen)
            if out.finished:
                del self._live[out.request_id]
                self.events.finished("error" if out.error else out.outputs[0].finish_reason or "stop",
                                     time.monotonic() - live.arrival)
            self._push(live.group, live.index, EngineError(out.error) if out.error else out)

    def _recover(self, exc: Exception) -> None:
        """``step()`` raised: fail every live request, discard the in-flight step, check integrity.
        A failed executor (a tensor-parallel rank died) cannot recover: its requests end as a shutdown's
        (HTTP 503 ``server_shutdown``; a stream's last chunk with finish_reason "abort", then [DONE]), later
        ones get 503, and the server,
        which reads the same failure (kvq.server.launch), stops."""
        failure = self.engine.executor.failure
        if failure:
            self.dead_reason = f"{failure}; the server is stopping: retry on another replica"
            err = ShuttingDown(self.dead_reason)
            for live in self._live.values():
                self._push(live.group, live.index, err)
                self.events.finished("error")
            self._live.clear()
            self._stop.set()
            return
        traceback.print_exc()
        err = EngineError(f"the engine failed during a step ({type(exc).__name__}: {exc}); the request was "
                          "aborted and the engine recovered")
        for rid, live in list(self._live.items()):
            self._push(live.group, live.index, err)
            self.events.finished("error")
        try:
            for rid in list(self._live):
                self.engine.abort(rid)
            self._live.clear()
            sched = self.engine.scheduler
            self.engine.discard_inflight()  # the launched step(s); their sequences are all aborted now
            sched.check_integrity()
            self.engine.block_manager.check_integrity()
            self.num_recoveries += 1
        except Exception as e2:  # noqa: BLE001 - recovery failed: the engine is dead
            self.dead_reason = (f"the engine failed ({type(exc).__name__}: {exc}) and could not recover "
                                f"({type(e2).__name__}: {e2})")
            self._stop.set()

    def _push(self, group: RequestGroup, index: int, item) -> None:
        try:
            group.loop.call_soon_threadsafe(group.queue.put_nowait, (index, item))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _fail_pending(self, reason: str) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, (_Add, _Check)) and cmd.reply.set_running_or_notify_cancel():
                cmd.reply.set_exception(EngineDeadError(reason))

    def _integrity(self) -> dict:
        """Run on the engine thread, between steps."""
        bm, sched = self.engine.block_manager, self.engine.scheduler
        error = None
        try:
            bm.check_integrity()
            sched.check_integrity()
        except AssertionError as e:
            error = str(e) or "integrity check failed"
        idle = not self.engine.has_unfinished()
        if idle:  # the CPU prefix cache's stores hold their blocks until they end: let them end
            self.engine.poll_host_copies(wait=True)
        used = {pool: bm.allocator(pool).num_used for pool in bm.pools}
        return {"ok": error is None, "error": error, "idle": idle, "used_blocks": used,
                # with no request left, any block still referenced is leaked
                "leaked_blocks": sum(used.values()) if idle else None}

    def _snapshot(self) -> dict:
        bm, sched = self.engine.block_manager, self.engine.scheduler
        blocks = {}
        for pool in bm.pools:  # q, hp, and a tiered cache's lower tiers (q1, q2...)
            a = bm.allocator(pool)
            blocks[pool] = {"total": a.num_blocks, "used": a.num_used, "free": a.num_free, "cached": a.num_cached}
        plan = self.engine.plan
        tiers = [dict(row, format=name, bytes_per_block=plan.tier_bytes_per_block(row["tier"]),
                      used_bytes=row["used"] * plan.tier_bytes_per_block(row["tier"]))
                 for row, name in zip(bm.tier_counts(), plan.tier_names())]
        return {
            "running": sched.num_running,
            "waiting": sched.num_waiting,
            "swapped": sched.num_swapped,
            # elastic precision: blocks, bytes and demotions (into each tier) per tier; pressure's share
            "tiers": tiers,
            "pressure_demotions": sched.num_demotions,
            "demotion_seconds": clock.seconds if (clock := getattr(self.engine.runner, "demote_clock", None)) else 0.0,
            "swap": {"out": sched.num_swapped_out, "in": sched.num_swapped_in, "fallbacks": sched.num_swap_fallbacks,
                     "failures": sched.num_swap_failures,
                     "host_blocks": {p: {"total": h.num_blocks, "used": h.num_used}
                                     for p, h in ((p, bm.host_allocator(p)) for p in ("q", "hp"))}},
            "cpu_offload": self.engine.host_offload_stats(),
            "live_requests": len(self._live),
            "kv_blocks": blocks,
            "steps": self.num_steps,
            "recoveries": self.num_recoveries,
            "time": time.time(),
        }
