"""Tensor parallelism: how a model and its KV cache split over ranks (:mod:`~kvq.parallel.partition`,
tensor-free), the process group the ranks talk over (:mod:`~kvq.parallel.group`), the sharded weights
(:mod:`~kvq.parallel.shard`), and the ranks other than 0 following rank 0's steps (:mod:`~kvq.parallel.worker`)."""
