"""The ranks of a tensor-parallel engine and what they say to each other, over torch.distributed.

Two process groups, both with ``timeout`` seconds for a rank that hangs: the compute group (NCCL on
CUDA, gloo on the CPU) carries the all-reduces of the row-parallel layers and the gather of the LM
head's logits; the control group (gloo) carries rank 0's step messages to the other ranks, and,
while the engine idles, a heartbeat every quarter of the timeout, so that a waiting rank hears
from rank 0 in time and rank 0 finds out about a rank that stopped answering.  A rank that dies
closes its sockets, so the others' next collective fails at once rather than at the timeout.

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
import socket
import threading
import time

import torch
import torch.distributed as dist

logger = logging.getLogger("kvq")

#: Seconds a collective of the compute group waits for a rank before the engine fails.
DEFAULT_TIMEOUT_S = 600.0


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world, local rank) when torchrun (or another launcher) set the environment, else None."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


class TPGroup:
    """This process's rank and its two process groups."""

    def __init__(self, rank: int, world: int, local_rank: int, device: torch.device, timeout_s: float,
                 workers: list | None = None, launched_by: str = "kvq"):
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.device = device
        self.timeout_s = timeout_s
        self.workers = workers or []  # the processes of ranks 1..N-1 when this rank 0 spawned them
        self.launched_by = launched_by
        self.compute = dist.group.WORLD
        self.control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.control_lock = threading.RLock()  # rank 0: one exchange on the control group at a time
        self.closed = False
        self._beat: threading.Thread | None = None
        self.beat_error: Exception | None = None

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
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def all_ints(self, n: int) -> list[int]:
        """Every rank's ``n``, in rank order."""
        parts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(parts, torch.tensor([n], dtype=torch.int64), group=self.control)
        return [int(p.item()) for p in parts]

    # -- rank 0's messages -------------------------------------------------------------------------
    def send(self, message) -> None:
        """Rank 0: hand ``message`` (picklable) to every other rank."""
        with self.control_lock:
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

    def close(self, stop_workers: bool = True) -> None:
        """Rank 0: tell the others to stop, wait for the processes it spawned (then terminate them),
        and leave the process groups.  Safe to call twice."""
        if self.closed:
            return
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

