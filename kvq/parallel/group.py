"""The ranks of a tensor-parallel engine and what they say to each other, over torch.distributed.

Two process groups with ``timeout`` seconds for a rank that hangs: the compute group (NCCL on
CUDA, gloo on the CPU) carries the all-reduces of the row-parallel layers and the gather of the LM
head's logits; the control group (gloo) carries rank 0's step messages to the other ranks, and,
while the engine idles, a heartbeat every quarter of the timeout, so that a waiting rank hears
from rank 0 in time and rank 0 finds out about a rank that stopped answering.  A rank that dies
closes its sockets, so the others' next collective fails at once rather than at the timeout.
A third group (gloo) carries the start's agreements (the pool every rank can hold, each rank's
pool bytes) with :data:`STARTUP_TIMEOUT_S` at least: ranks reach them after loading their weights
and profiling memory, which may take one rank longer than the step timeout (a busy host, a slow
disk) without it hanging.

Failure is one state, :attr:`TPGroup.failure` (the first reason wins), set by whoever sees it
first: rank 0's watchdog over the processes it spawned (a rank that exits while the group is open:
at once, whether or not the engine is stepping), the heartbeat, or a step that raised.  From then
on every send raises at once, and whoever owns the process (``kvq serve``: kvq.server.launch) can
read why and stop::

    rank 1 killed ──> watchdog: failure = "rank 1 (pid N) was killed by SIGKILL" ──> on_failure callbacks
                      next send / step raises at once; close() sends no stop message, reaps the others

Ranks start in one of two ways (:func:`start`):

* by kvq: the process that builds the engine becomes rank 0 and spawns ranks 1..N-1
  (``multiprocessing`` spawn), each of which builds the same engine and follows rank 0
  (:mod:`kvq.parallel.worker`); they end with the engine;
* by torchrun (``WORLD_SIZE``/``RANK``/``MASTER_ADDR`` in the environment, which also spans nodes):
  every process runs the same command, rank 0 serves, the others follow and exit when it ends.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

logger = logging.getLogger("kvq")

#: Seconds a collective of the compute group waits for a rank before the engine fails.
DEFAULT_TIMEOUT_S = 600.0
#: Seconds the start's agreements wait at least (loading weights is not a hang).
STARTUP_TIMEOUT_S = 600.0


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world, local rank) when torchrun (or another launcher) set the environment, else None."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


class TPGroup:
    """This process's rank and its three process groups."""

    def __init__(self, rank: int, world: int, local_rank: int, device: torch.device, timeout_s: float,
                 workers: list | None = None, launched_by: str = "kvq"):
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.device = device
        self.timeout_s = timeout_s
        self.workers = workers or []  # the processes of ranks 1..N-1 when this rank 0 spawned them
        self.launched_by = launched_by
        self.compute = dist.group.WORLD
        self.control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.startup = dist.new_group(backend="gloo",
                                      timeout=datetime.timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S)))
        self.control_lock = threading.RLock()  # rank 0: one exchange on the control group at a time
        self.closed = False
        self._stopping = False  # rank 0 is telling the others to stop: their exits are expected
        self._beat: threading.Thread | None = None
        self.beat_error: Exception | None = None
        self.failure: str | None = None  # why this group cannot go on (module docstring), first reason wins
        self._failure_lock = threading.Lock()
        self._on_failure: list = []
        if self.workers:
            threading.Thread(target=self._watch_workers, name="kvq-tp-watchdog", daemon=True).start()

    # -- failure -------------------------------------------------------------------------------------
    def on_failure(self, callback) -> None:
        """Call ``callback(reason)`` (from the thread that sees it) once the group fails; at once if it
        already has."""
        with self._failure_lock:
            if self.failure is None:
                self._on_failure.append(callback)
                return
        callback(self.failure)

    def fail(self, reason: str) -> None:
        """Record why the group cannot go on (the first reason is kept), say it on stderr, tell the
        callbacks.  Any thread."""
        with self._failure_lock:
            if self.failure is not None or self.closed:
                return
            self.failure = reason
            callbacks, self._on_failure = self._on_failure, []
        print(f"[kvq] {reason}; the engine cannot go on without it", file=sys.stderr, flush=True)
        for callback in callbacks:
            try:
                callback(reason)
            except Exception:  # noqa: BLE001 - one listener's bug must not hide the failure from the others
                logger.exception("tensor parallel: a failure callback raised")

    def _watch_workers(self) -> None:
        """Rank 0: wait on the spawned ranks' process sentinels; one that ends while the group is open
        (not after a stop message) fails the group at once."""
        from multiprocessing.connection import wait

        by_sentinel = {p.sentinel: (rank, p) for rank, p in enumerate(self.workers, start=1)}
        while not (self.closed or self._stopping) and by_sentinel:
            for sentinel in wait(list(by_sentinel), timeout=0.5):
                rank, p = by_sentinel.pop(sentinel)
                code, until = p.exitcode, time.monotonic() + 1.0
                while code is None and time.monotonic() < until:  # (its sentinel closes as it dies)
                    time.sleep(0.01)
                    code = p.exitcode
                if not (self.closed or self._stopping):
                    self.fail(f"tensor parallel: a rank failed: rank {rank} (pid {p.pid}) {describe_exit(code)}")

    # -- collectives of the forward ----------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.compute)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[B, n] on every rank -> [B, world * n], rank r's columns at r * n."""
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.compute)
        return torch.cat(parts, dim=-1)

    def min_int(self, n: int) -> int:
        """The least of every rank's ``n`` (a start agreement: on the startup group)."""
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.startup)
        return int(t.item())

    def all_ints(self, n: int) -> list[int]:
        """Every rank's ``n``, in rank order (a start agreement: on the startup group)."""
        parts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(parts, torch.tensor([n], dtype=torch.int64), group=self.startup)
        return [int(p.item()) for p in parts]

    # -- rank 0's messages -------------------------------------------------------------------------
    def send(self, message) -> None:
        """Rank 0: hand ``message`` (picklable) to every other rank."""
        with self.control_lock:
            if self.failure is not None:
                raise RuntimeError(self.failure)
            if self.beat_error is not None:
                raise RuntimeError(f"heartbeat: {self.beat_error}")
            dist.broadcast_object_list([message], src=0, group=self.control)

    def start_heartbeat(self) -> None:
        """Rank 0, once every rank is built: a ("beat",) message every quarter of the timeout."""
        def beat():
            while not self.closed:
                time.sleep(self.timeout_s / 4)
                try:
                    with self.control_lock:
                        if self.closed:  # (the stop message went out: nobody listens any more)
                            return
                        dist.broadcast_object_list([("beat",)], src=0, group=self.control)
                except Exception as e:  # noqa: BLE001 - kept for the engine's next send to report
                    self.beat_error = e
                    self.fail(f"tensor parallel: the heartbeat to the other ranks failed ({type(e).__name__}: "
                              f"{_first_line(e)})")
                    return

        self._beat = threading.Thread(target=beat, name="kvq-tp-heartbeat", daemon=True)
        self._beat.start()

    def receive(self):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather_from(self, src: int, obj):
        """Every rank: ``src``'s ``obj`` (picklable; the others pass None)."""
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.control)
        return box[0]

    # -- the end -------------------------------------------------------------------------------------
    def worker_exit_codes(self) -> list:
        return [p.exitcode for p in self.workers]

    def dead_ranks(self, wait_s: float = 0.0) -> str | None:
        """The spawned ranks that have exited, in words ("rank 1 (pid N) was killed by SIGKILL"),
        waiting up to ``wait_s`` for one to; None if all run (or none were spawned here)."""
        from multiprocessing.connection import wait

        if self.workers and wait_s > 0:
            ready = wait([p.sentinel for p in self.workers], timeout=wait_s)
            until = time.monotonic() + 1.0  # its sentinel closes as it dies; its exit status comes a moment later
            for p in self.workers:
                while p.sentinel in ready and p.exitcode is None and time.monotonic() < until:
                    time.sleep(0.01)
        dead = [(rank, p) for rank, p in enumerate(self.workers, start=1) if not p.is_alive()]
        return ", ".join(f"rank {rank} (pid {p.pid}) {describe_exit(p.exitcode)}" for rank, p in dead) or None

    def close(self, stop_workers: bool = True) -> None:
        """Rank 0: tell the others to stop, wait for the processes it spawned (then terminate them),
        and leave the process groups.  Safe to call twice.  After a failure no stop message is sent
        (a rank that hangs would hold it up to the timeout): the processes are ended."""
        if self.closed:
            return
        stop_workers = stop_workers and self.failure is None
        self._stopping = True
        with self.control_lock:
            if stop_workers and self.rank == 0:
                try:
                    dist.broadcast_object_list([("stop",)], src=0, group=self.control)
                except Exception as e:  # noqa: BLE001 - a rank already gone: nothing to tell it
                    logger.debug("tensor parallel: stop message not delivered: %s", e)
            self.closed = True
        for p in self.workers:  # after a stop message they end by themselves; after a failure, now
            p.join(timeout=30 if stop_workers else 0.1)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()  # (also ends a stopped process)
                p.join(timeout=5)
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - already torn down by a failed collective
            logger.debug("tensor parallel: destroy_process_group: %s", e)


def describe_exit(code: int | None) -> str:
    """A process's exit code in words: "was killed by SIGKILL", "exited with status 1"."""
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """Each rank's device: cuda:LOCAL_RANK on CUDA, the CPU otherwise."""
    if device.type != "cuda":
        return device
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"tensor parallel rank {local_rank} needs cuda:{local_rank}, and this machine has "
                         f"{torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", local_rank)


def _init(rank: int, world: int, device: torch.device, init_method: str, timeout_s: float) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def start(config, world: int, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S, target=None) -> TPGroup:
    """This process's rank of a ``world``-rank engine built from ``config`` (an EngineConfig): the
    environment's under torchrun, else rank 0 of a new group whose other ranks it spawns now, each
    running ``target(config, rank, world, init_method, timeout_s)`` (kvq.parallel.worker.spawned_worker)."""
    env = torchrun_env()
    if env is not None:
        rank, env_world, local_rank = env
        if env_world != world:
            raise ValueError(f"tensor_parallel_size {world} differs from the launcher's WORLD_SIZE {env_world}: "
                             f"start {world} processes (torchrun --nproc-per-node {world})")
        dev = rank_device(device, local_rank)
        if not dist.is_initialized():
            _init(rank, world, dev, "env://", timeout_s)
        return TPGroup(rank, world, local_rank, dev, timeout_s, launched_by="torchrun")
    import multiprocessing as mp

    dev = rank_device(device, 0)
    init = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    workers = []
    for r in range(1, world):
        p = ctx.Process(target=target, args=(config, r, world, init, timeout_s), daemon=True,
                        name=f"kvq-tp-rank{r}")
        p.start()
        workers.append(p)
    try:
        _init(0, world, dev, init, timeout_s)
        group = TPGroup(0, world, 0, dev, timeout_s, workers)
    except Exception as e:
        for p in workers:
            p.kill()
        raise RuntimeError(f"tensor parallel: ranks 1..{world - 1} did not join ({e}); exit codes "
                           f"{[p.exitcode for p in workers]}") from None
    return group

