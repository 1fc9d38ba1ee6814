"""Tensor parallelism as an executor (kvq.engine.executor): rank 0's worker in the engine's process,
ranks 1..N-1 each a :class:`~kvq.engine.worker.Worker` in a process of its own, started by kvq
(spawned) or by torchrun, following rank 0's steps (:mod:`kvq.parallel.worker`)."""

from __future__ import annotations

import atexit

from kvq.cache.partition import head_partition
from kvq.engine.config import EngineConfig, resolve_device, resolve_dtype
from kvq.engine.executor import Executor
from kvq.engine.worker import Worker
from kvq.models.source import model_shape, resolve_model
from kvq.parallel import group as tp
from kvq.parallel.worker import BroadcastRunner, follow, spawned_worker


def dist_backend() -> str:
    import torch.distributed as dist

    return dist.get_backend() if dist.is_initialized() else "none"


class TensorParallelExecutor(Executor):
    """``cfg.tensor_parallel_size`` ranks over torch.distributed (NCCL on CUDA, gloo on the CPU)."""

    def __init__(self, cfg: EngineConfig):
        n = cfg.tensor_parallel_size
        device = resolve_device(cfg.device)
        resolve_dtype(cfg.dtype, device)
        shape = model_shape(resolve_model(cfg.model))
        cfg.kv_cache_config.plan(shape)
        head_partition(shape, n, 0)  # the choices and the geometry are valid before any rank starts
        self.tp = tp.start(cfg, n, device, cfg.distributed_timeout_s, target=spawned_worker)
        if self.tp.rank == 0:
            atexit.register(self.tp.close)
        try:
            self.worker = Worker(cfg, self.tp)
        except BaseException:
            self.tp.close(stop_workers=False)  # the other ranks stop with this one
            raise
        if self.tp.rank != 0:  # a torchrun rank: rank 0 drives; this process has nothing else to do
            follow(self.tp, self.worker.runner)
            raise SystemExit(0)
        self.runner = BroadcastRunner(self.worker.runner, self.tp)

    @property
    def group(self):
        return self.tp

    @property
    def failure(self) -> str | None:
        """Why the ranks cannot go on (a rank died or hung: :attr:`TPGroup.failure`), or None.  A rank
        that dies is seen at once, even while the engine idles; the next step raises."""
        return self.tp.failure

    def execute(self, sched, seqs: dict, feed=None):
        return self.runner.execute(sched, seqs, feed)

    def apply_ops(self, ops) -> None:
        self.runner.apply_ops(ops)

    def rank_pools(self) -> list[list[dict]]:
        return self.runner.rank_pools()

    def info(self) -> dict:
        """Per-rank heads and KV bytes, and the totals: what `kvq plan` and the capacity report show."""
        w = self.worker
        parts = [head_partition(w.full_plan.model, self.tp.world, r) for r in range(self.tp.world)]
        rank_bytes = w.rank_pool_bytes
        return {"size": self.tp.world, "launched_by": self.tp.launched_by, "backend": dist_backend(),
                "kv_head_replicas": parts[0].replicas,
                "kv_heads_per_rank": [list(p.kv_heads) for p in parts], "kv_pool_bytes_per_rank": rank_bytes,
                "kv_pool_bytes_total": sum(rank_bytes)}

    def ready(self) -> None:
        self.tp.start_heartbeat()  # every rank is built: from here the others wait on rank 0

    def shutdown(self) -> None:
        self.tp.close()
