"""Ranks 1..N-1 of a tensor-parallel engine: build this rank's Worker (kvq.engine.worker: its model
shard, cache shard and runner; never an engine), then run what rank 0 tells them, step by step, until
it says stop.

Rank 0 keeps the scheduler, the block manager and the sampler; its :class:`BroadcastRunner` sends
each step's data object (the scheduler's output, with the tokens it feeds) to the others before
running it, so every rank runs the same forward on its own heads and the collectives inside it
meet.  Cache ops (seals, copies) travel the same way.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading

import torch

from kvq.engine.worker import Worker, pool_state

logger = logging.getLogger("kvq")

class StepTokens:
    """The tokens a step feeds, per sequence, standing in for the engine's sequences on ranks > 0."""

    def __init__(self, tokens: dict[int, tuple[int, list[int]]]):
        self.tokens = tokens  # seq id -> (start position, tokens from there)

    def __getitem__(self, seq_id: int) -> "StepTokens._One":
        return StepTokens._One(*self.tokens[seq_id])

    class _One:
        def __init__(self, start: int, ids: list[int]):
            self.start, self.ids = start, ids

        def token_ids(self, a: int, b: int) -> list[int]:
            return self.ids[a - self.start: b - self.start]


def step_tokens(sched, seqs) -> StepTokens:
    return StepTokens({it.seq_id: (it.start, seqs[it.seq_id].token_ids(it.start, it.start + it.num_new_tokens))
                       for it in sched.scheduled})


class BroadcastRunner:
    """Rank 0's runner: each call is sent to the other ranks, then run here."""

    def __init__(self, runner, group):
        self.runner, self.group = runner, group

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def _send(self, message) -> None:
        try:
            self.group.send(message)
        except Exception as e:  # noqa: BLE001
            raise self.failed(e) from None

    def failed(self, e: Exception) -> RuntimeError:
        """A rank died or hung: every rank is stopped, and the error says which (a dead rank by its
        number and how it ended; else the collective's error and the exit codes)."""
        # a collective fails as soon as a dead peer's sockets close, which can come a second or more before
        # its process is reaped on a loaded machine (seen: 0.5 s was not enough on 2 busy cores)
        dead = self.group.dead_ranks(wait_s=2.0)
        why = f"tensor parallel: a rank failed: {dead}" if dead else \
            (f"tensor parallel: a rank failed ({type(e).__name__}: {_first_line(e)}); worker exit codes "
             f"{self.group.worker_exit_codes()}")
        self.group.fail(why)
        self.group.close(stop_workers=False)
        return RuntimeError(f"{why}; the engine is shut down")

    def apply_ops(self, ops) -> None:
        self._send(("ops", ops))
        try:
            self.runner.apply_ops(ops)
        except Exception as e:  # noqa: BLE001
            raise self.failed(e) from e

    def rank_pools(self) -> list[list[dict]]:
        """Every rank's cache, copied to the CPU: per rank, per layer, its tensors by name (K/V planes,
        high-precision blocks, static scales) -- what each rank stores, to inspect or compare."""
        with self.group.control_lock:  # no heartbeat between the request and the answers
            self._send(("pools",))
            mine = pool_state(self.runner.pool)
            return [mine] + [self.group.gather_from(r, None) for r in range(1, self.group.world)]

    def execute(self, sched, seqs, feed=None):
        if feed is not None:
            raise RuntimeError("tensor parallelism runs without asynchronous scheduling")
        tokens = step_tokens(sched, seqs)
        self._send(("step", sched, tokens.tokens))
        try:
            return self.runner.execute(sched, tokens)
        except Exception as e:  # noqa: BLE001 - the other ranks are mid-step: none can go on without this one
            raise self.failed(e) from e


def follow(group, runner) -> None:
    """Run rank 0's messages on this rank's runner until it says stop (or its socket closes)."""
    while True:
        message = group.receive()
        kind = message[0]
        if kind == "stop":
            break
        if kind == "beat":
            continue
        if kind == "ops":
            runner.apply_ops(message[1])
        elif kind == "pools":
            for r in range(1, group.world):
                group.gather_from(r, pool_state(runner.pool) if r == group.rank else None)
        elif kind == "step":
            runner.execute(message[1], StepTokens(message[2]))
        else:
            raise RuntimeError(f"tensor parallel: unknown message {kind!r}")
    group.close(stop_workers=False)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def _exit_with_parent(rank: int) -> None:
    """A daemon thread that ends this process when the process that spawned it is gone (SIGKILLed, or
    exited without stopping this rank): a rank blocked loading or in a collective would wait for
    the distributed timeout otherwise."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()  # (waits on the parent's sentinel)
        print(f"[kvq] tensor parallel rank {rank}: rank 0's process is gone; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="kvq-tp-parent-watch", daemon=True).start()


def spawned_worker(config, rank: int, world: int, init_method: str, timeout_s: float) -> None:
    """Entry point of a rank that kvq spawned: join the group, build this rank's Worker (model shard,
    cache shard, runner), follow rank 0."""
    from kvq.engine.config import resolve_device
    from kvq.parallel import group as tp

    # Ctrl-C in a terminal reaches the whole process group: only rank 0 acts on it (its drain stops
    # this rank with a stop message); and this rank never outlives rank 0's process
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent(rank)
    os.environ.pop("WORLD_SIZE", None)  # this rank's group is kvq's, whatever the parent's environment
    try:
        device = tp.rank_device(resolve_device(config.device), rank)
        tp._init(rank, world, device, init_method, timeout_s)
        group = tp.TPGroup(rank, world, rank, device, timeout_s)
        worker = Worker(config, group)
        follow(group, worker.runner)
    except Exception as e:  # noqa: BLE001 - reported by rank 0 from the exit code and its own error
        print(f"[kvq] tensor parallel rank {rank} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        torch.distributed.destroy_process_group() if torch.distributed.is_initialized() else None
        sys.exit(1)
