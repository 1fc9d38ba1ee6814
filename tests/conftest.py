"""Test set-up: without a GPU, Triton kernels run under its CPU interpreter; one torch thread.

The suite is many small ops on a small model, run on shared 2-core machines: one thread per
process is the fastest there (README, "Threads"), and it is what engines built without
``threads`` pick on the CPU anyway.  OMP_NUM_THREADS also reaches the `kvq` subprocesses
the tests start."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402  (after OMP_NUM_THREADS: read when torch starts its thread pool)

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"].split(",")[0] or 1))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
