"""Executors: how an engine's steps reach the workers that compute them.

The engine core (:class:`~kvq.engine.llm_engine.LLMEngine`) schedules, hands each step to its
executor and reads back logits; it never knows whether one process computes them or several ranks.
An executor owns its workers (:class:`~kvq.engine.worker.Worker`: a model shard, a cache shard and
a runner each) and their processes:

* :class:`UniprocExecutor` -- one worker, in the engine's process;
* tensor parallelism over torch.distributed (:mod:`kvq.parallel.executor`): rank 0's worker here,
  ranks 1..N-1 in processes of their own (started by kvq or by torchrun), each running a Worker that
  follows rank 0's steps.  A torchrun- or Ray-launched multi-node executor would implement the same
  interface.

Implementations above this floor are registered by name by the package's entry point
(:mod:`kvq.engine.registry`, kvq/__init__.py), so the engine picks one from the config without
importing up.
"""

from __future__ import annotations

import importlib

from kvq.engine.config import EngineConfig
from kvq.engine.registry import EXECUTORS
from kvq.engine.worker import Worker, pool_state


class Executor:
    """What the engine needs of the workers.  ``worker`` is the engine process's own (rank 0): the engine
    reads its plan, pools, model and tokenizer."""

    worker: Worker

    def execute(self, sched, seqs: dict, feed=None):
        """Run one scheduler output on every worker -> rank 0's (logits, sample ids)."""
        raise NotImplementedError

    def apply_ops(self, ops) -> None:
        """Run cache ops (seals, copies, swaps) on every worker."""
        raise NotImplementedError

    def rank_pools(self) -> list[list[dict]]:
        """Every worker's cache on the CPU: per rank, per layer, its tensors by name."""
        raise NotImplementedError

    def info(self) -> dict | None:
        """The ranks, their KV heads and KV bytes (None for one process)."""
        return None

    def ready(self) -> None:
        """The engine is built around the workers: from here they wait on it."""

    def shutdown(self) -> None:
        """Stop the workers' processes (nothing to do in one process)."""

    @property
    def group(self):
        """The tensor-parallel process group of rank 0, or None."""
        return None

    @property
    def failure(self) -> str | None:
        """Why the workers cannot go on (a rank died or hung), or None; one process never fails this way."""
        return None


class UniprocExecutor(Executor):
    """One worker in the engine's process."""

    def __init__(self, cfg: EngineConfig):
        self.worker = Worker(cfg)

    def execute(self, sched, seqs: dict, feed=None):
        return self.worker.runner.execute(sched, seqs, feed)

    def apply_ops(self, ops) -> None:
        self.worker.runner.apply_ops(ops)

    def rank_pools(self) -> list[list[dict]]:
        return [pool_state(self.worker.pool)]


def make_executor(cfg: EngineConfig) -> Executor:
    """The executor ``cfg`` asks for: tensor parallel when ``tensor_parallel_size > 1`` (the class that
    kvq's entry point registered, :mod:`kvq.engine.registry`), else one process."""
    if cfg.tensor_parallel_size > 1:
        target = EXECUTORS.get("tensor_parallel")
        if target is None:
            raise RuntimeError("tensor_parallel_size > 1: no tensor-parallel executor is registered "
                               "(kvq/__init__.py registers kvq.parallel.executor)")
        module, _, name = target.partition(":")
        return getattr(importlib.import_module(module), name)(cfg)
    return UniprocExecutor(cfg)
