"""Tensor parallelism: the process group the ranks talk over (:mod:`~kvq.parallel.group`) and the ranks
other than 0 following rank 0's steps (:mod:`~kvq.parallel.worker`).  How a model and its KV cache split
over ranks is tensor-free geometry one floor down (:mod:`kvq.cache.partition`), and the sharded weights are
the models' (:mod:`kvq.models.shard`)."""
