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


#: The longest tests (15-50 s each on the 2-core machines), longest first: run before all others.  `make test`
#: hands each pytest-xdist worker a contiguous half of the collection and steals from the end of a worker's
#: queue, never the test it runs nor the last two it holds; test_tune's end-to-end test (about 50 s) sat
#: near the end of the collection, and the other worker waited for it, idle, for most of that time.  With
#: the long ones first, what is left to steal at the end is short.  Only tests without module-scoped
#: fixtures (moving one out of its module would build its fixture twice); a name not collected is ignored.
LONG_FIRST = (
    "tests/test_tune.py::test_tune_end_to_end_on_the_default_model",
    # four shards, about 50 s each with a cold Triton cache (a fresh machine, as CI's), a few seconds warm
    "tests/test_triton_compile.py::test_all_kernels_compile_for_sm90",
    "tests/test_soak.py::test_soak_drain_restart_preemption_and_host_faults",
    "tests/test_soak.py::test_soak_nixl_peer_death_and_tensor_parallel_rank_death",
    "tests/test_transfer_serve.py::test_tiered_servers_on_both_sides_of_a_transfer",
    "tests/test_soak.py::test_soak_elastic_demotes_then_swaps_with_failing_copies",
    "tests/test_tensor_parallel.py::test_two_ranks_match_one",
    "tests/test_transfer_serve.py::test_two_kvq_serve_processes_with_an_api_key",
    "tests/test_eval.py::test_tiny_eval_end_to_end_catches_a_broken_quantizer",
    "tests/test_swap.py::test_swapped_requests_give_the_tokens_of_an_unpressed_run",
    "tests/test_prefill_window.py::test_logits_do_not_depend_on_the_prefill_chunk",
    "tests/test_scheduler.py::TestSchedulerMachine",
    "tests/test_batch_invariance.py::test_one_prompt_alone_and_batched_gives_the_same_tokens",
    "tests/test_tensor_parallel.py::test_two_ranks_age_blocks_into_their_tier_as_one_does",
    "tests/test_cpu_prefix_tier.py::test_reloaded_prefixes_give_the_tokens_of_a_run_without_the_tier",
    "tests/test_model_loader.py::test_converted_copy_is_the_gguf_load_exactly",
    "tests/test_server_shutdown.py::test_shutdown_timeout_0_ends_streams_at_once_and_a_second_sigint_cuts_a_drain",
    "tests/test_server_shutdown.py::test_sigterm_drains_then_ends_the_rest_with_abort",
    "tests/test_server_shutdown.py::test_sigint_drains_like_sigterm",
    "tests/test_tensor_parallel.py::test_a_hung_rank_times_out_and_every_rank_stops",
    "tests/test_split_prefill.py::test_bench_prefill_smoke",
)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        name = item.nodeid.split("[")[0]
        return next((i for i, long in enumerate(LONG_FIRST) if name == long or name.startswith(long + "::")),
                    len(LONG_FIRST))

    items[:] = sorted(items, key=rank)  # (stable: the rest keep their order)
